// Module jaeger pins the Jaeger v2 binary that make jaeger builds into bin/
// (the demo's trace backend and the tests' Jaeger). It holds no code of its
// own: go build -o ../../bin/jaeger github.com/jaegertracing/jaeger/cmd/jaeger.
package jaeger
