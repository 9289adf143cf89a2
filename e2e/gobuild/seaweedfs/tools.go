//go:build tools

// Package tools pins the command this module builds, so `go mod tidy` keeps its deps.
package tools

import _ "github.com/seaweedfs/seaweedfs/weed"
