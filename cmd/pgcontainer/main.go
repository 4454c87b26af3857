// Command pgcontainer starts a PostgreSQL container with testcontainers-go
// for the tests (internal/pgtest runs it when there is no TEST_DATABASE_URL
// and no local PostgreSQL binaries, and a Docker engine answers). It prints
// the connection URL on one line, keeps the container until its standard
// input closes, then terminates it. It lives in the tooling module so the
// library's module graph holds no Docker client.
package main

import (
	"context"
	"fmt"
	"io"
	"log"
	"os"
	"time"

	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
)

func main() {
	if err := run(); err != nil {
		log.Fatal(err)
	}
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	ctr, err := tcpostgres.Run(ctx, "postgres:16-alpine",
		tcpostgres.WithUsername("postgres"),
		tcpostgres.WithPassword("postgres"),
		tcpostgres.WithDatabase("postgres"),
		tcpostgres.BasicWaitStrategies(),
	)
	if err != nil {
		return fmt.Errorf("start container: %w", err)
	}
	defer func() { _ = ctr.Terminate(context.Background()) }()
	url, err := ctr.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		return err
	}
	fmt.Println(url)
	_, _ = io.Copy(io.Discard, os.Stdin) // until the test process closes it
	return nil
}
