// Package toolbin finds the programs the Makefile builds into the
// repository's git-ignored bin/ (the Temporal CLI, Jaeger), from any
// package directory of either module of the workspace.
package toolbin

import (
	"errors"
	"os"
	"path/filepath"
)

// Path returns bin/<name> in the nearest directory, from the working
// directory up, that has one.
func Path(name string) (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		p := filepath.Join(dir, "bin", name)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New(name + " not found in any bin/ from the working directory up")
		}
		dir = parent
	}
}
