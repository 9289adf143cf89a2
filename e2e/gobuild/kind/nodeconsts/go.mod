// nodeconsts prints a string constant of kind's node image builder (the default storage manifest
// and the image names it preloads), so e2e/kind/node-image.sh writes exactly what
// `kind build node-image` would. Standard library only.
module crucible.invalid/e2e/kind/nodeconsts

go 1.26.0
