// Command nodeconsts prints the value of a string constant declared in the const*.go files of a
// Go package directory, evaluated by go/types (so concatenations such as
// `...` + storageHelperImage + `...` come out as the compiler sees them).
//
//	nodeconsts DIR NAME
package main

import (
	"fmt"
	"go/ast"
	"go/constant"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"os"
	"path/filepath"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: nodeconsts DIR NAME")
		os.Exit(2)
	}
	dir, name := os.Args[1], os.Args[2]
	paths, err := filepath.Glob(filepath.Join(dir, "const*.go"))
	if err != nil || len(paths) == 0 {
		fmt.Fprintf(os.Stderr, "nodeconsts: no const*.go in %s\n", dir)
		os.Exit(1)
	}
	fset := token.NewFileSet()
	var files []*ast.File
	for _, p := range paths {
		f, err := parser.ParseFile(fset, p, nil, 0)
		if err != nil {
			fmt.Fprintln(os.Stderr, "nodeconsts:", err)
			os.Exit(1)
		}
		files = append(files, f)
	}
	// Type errors elsewhere in these files (none expected) must not hide the constant.
	conf := types.Config{Importer: importer.Default(), Error: func(error) {}}
	pkg, _ := conf.Check(files[0].Name.Name, fset, files, nil)
	obj, ok := pkg.Scope().Lookup(name).(*types.Const)
	if !ok || obj.Val().Kind() != constant.String {
		fmt.Fprintf(os.Stderr, "nodeconsts: no string constant %s in %s\n", name, dir)
		os.Exit(1)
	}
	fmt.Print(constant.StringVal(obj.Val()))
}
