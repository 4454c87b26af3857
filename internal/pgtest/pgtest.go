// Package pgtest gives tests a real PostgreSQL server and a schema of their own.
//
// The server is found in this order:
//
//  1. TEST_DATABASE_URL, if set;
//  2. a throwaway cluster started from the local PostgreSQL binaries (initdb and
//     pg_ctl on a free port in a temporary directory; as root they run as the
//     postgres user), stopped and removed also when the test binary dies
//     without cleaning up (see Cluster.reap);
//  3. testcontainers-go's Postgres module, when a Docker engine answers;
//  4. otherwise the test fails when CI=true and is skipped with a message
//     elsewhere.
//
// One server is started per test process; call [Main] from TestMain so it is
// shut down when the tests end.
package pgtest

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

var (
	once     sync.Once
	server   *Server
	startErr error
)

// Server is a running PostgreSQL server.
type Server struct {
	// URL connects to the server as a superuser.
	URL string
	// Source says where the server came from: "TEST_DATABASE_URL", "local
	// binaries" or "testcontainers".
	Source string

	stop func() error
}

// Stop shuts the server down if this process started it.
func (s *Server) Stop() error {
	if s == nil || s.stop == nil {
		return nil
	}
	return s.stop()
}

// Main runs the tests and then stops the server started for them. Use it from
// TestMain: func TestMain(m *testing.M) { pgtest.Main(m) }.
func Main(m *testing.M) {
	code := m.Run()
	StopShared()
	os.Exit(code)
}

// StopShared stops the process-wide server if this process started one.
func StopShared() {
	if server != nil {
		if err := server.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: stopping server: %v\n", err)
		}
	}
}

// Start returns the process-wide server, starting it on first use.
func Start() (*Server, error) {
	once.Do(func() { server, startErr = start() })
	return server, startErr
}

// RequireServer returns the server or ends the test: it fails under CI=true
// and is skipped elsewhere, with the reason.
func RequireServer(tb testing.TB) *Server {
	tb.Helper()
	s, err := Start()
	if err != nil {
		unavailable(tb, "no PostgreSQL server (set TEST_DATABASE_URL, install PostgreSQL binaries, or run Docker)", err)
	}
	return s
}

// unavailable ends a test that cannot get what it needs: it fails under
// CI=true, where everything must be there, and is skipped elsewhere.
func unavailable(tb testing.TB, what string, err error) {
	tb.Helper()
	if os.Getenv("CI") == "true" {
		tb.Fatalf("pgtest: %s (required under CI=true): %v", what, err)
	}
	tb.Skipf("pgtest: %s, skipping: %v", what, err)
}

// NewCluster starts a cluster of the test's own (for tests that read the
// server log or restart the server), destroyed when the test ends. Without
// local PostgreSQL binaries it fails under CI=true and skips elsewhere.
func NewCluster(tb testing.TB, extra ...string) *Cluster {
	tb.Helper()
	c, err := StartCluster(extra...)
	if err != nil {
		unavailable(tb, "cannot start a cluster of the test's own", err)
	}
	tb.Cleanup(func() {
		if err := c.Destroy(); err != nil {
			tb.Errorf("pgtest: %v", err)
		}
	})
	return c
}

// LogPath is the server log of the cluster.
func (c *Cluster) LogPath() string { return filepath.Join(c.Dir, "server.log") }

// Schema is a schema created for one test, dropped when the test ends.
type Schema struct {
	// Name of the schema.
	Name string
	// Pool is a pool whose connections have search_path set to Name.
	Pool *pgxpool.Pool
	// URL connects with search_path set to Name.
	URL string
}

// NewSchema creates a fresh schema on the server and a pool bound to it.
func NewSchema(tb testing.TB) *Schema {
	tb.Helper()
	s := RequireServer(tb)
	ctx := context.Background()

	name := "t_" + randomHex(6)
	conn, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		tb.Fatalf("pgtest: connect: %v", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		tb.Fatalf("pgtest: create schema: %v", err)
	}

	url, err := WithSearchPath(s.URL, name)
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		tb.Fatalf("pgtest: parse url: %v", err)
	}
	cfg.MaxConns = 40
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		tb.Fatalf("pgtest: pool: %v", err)
	}
	tb.Cleanup(func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, s.URL)
		if err != nil {
			tb.Errorf("pgtest: cleanup connect: %v", err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE"); err != nil {
			tb.Errorf("pgtest: drop schema %s: %v", name, err)
		}
	})
	return &Schema{Name: name, Pool: pool, URL: url}
}

// WithSearchPath returns url (a postgres:// URL or a key=value DSN) with its
// search_path set to schema.
func WithSearchPath(url, schema string) (string, error) {
	if _, err := pgx.ParseConfig(url); err != nil {
		return "", fmt.Errorf("parse url: %w", err)
	}
	if !strings.HasPrefix(url, "postgres://") && !strings.HasPrefix(url, "postgresql://") {
		return url + " search_path=" + schema, nil
	}
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	return url + sep + "search_path=" + schema, nil
}

func start() (*Server, error) {
	if url := os.Getenv("TEST_DATABASE_URL"); url != "" {
		return &Server{URL: url, Source: "TEST_DATABASE_URL"}, nil
	}
	var errs []error
	s, err := startLocal()
	if err == nil {
		return s, nil
	}
	errs = append(errs, fmt.Errorf("local binaries: %w", err))
	s, err = startContainer()
	if err == nil {
		return s, nil
	}
	errs = append(errs, fmt.Errorf("testcontainers: %w", err))
	return nil, errors.Join(errs...)
}

// BinDir finds the directory holding initdb and pg_ctl: PG_BINDIR if set,
// then PATH, then the newest /usr/lib/postgresql/*/bin.
func BinDir() (string, error) {
	if d := os.Getenv("PG_BINDIR"); d != "" {
		return d, nil
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p), nil
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	if len(matches) == 0 {
		return "", errors.New("initdb not found (PATH, /usr/lib/postgresql/*/bin)")
	}
	sort.Slice(matches, func(i, j int) bool { return versionOf(matches[i]) > versionOf(matches[j]) })
	return filepath.Dir(matches[0]), nil
}

func versionOf(initdb string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(initdb))))
	return v
}

// Cluster is a PostgreSQL cluster started from local binaries.
type Cluster struct {
	Dir  string
	Port int
	// extra server options, appended after the defaults (later -c wins).
	extra string
	bin   string
	user  string // OS user running the server; "" for the current user
	// reaper holds open the pipe a reaper process reads (see reap).
	reaper io.Closer
}

// URL connects to the cluster as the postgres superuser.
func (c *Cluster) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", c.Port)
}

// StartCluster initialises and starts a cluster in a new temporary directory.
// The server runs with fsync and synchronous_commit off (tests need speed, not
// durability); extra server options (e.g. "-c fsync=on") override that.
func StartCluster(extra ...string) (*Cluster, error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "pgtest-")
	if err != nil {
		return nil, err
	}
	c := &Cluster{Dir: dir, bin: bin, extra: strings.Join(extra, " ")}
	if os.Geteuid() == 0 {
		// initdb refuses to run as root.
		if _, err := user.Lookup("postgres"); err != nil {
			return nil, fmt.Errorf("running as root and no postgres user: %w", err)
		}
		c.user = "postgres"
		if err := exec.Command("chown", "-R", "postgres", dir).Run(); err != nil {
			return nil, fmt.Errorf("chown %s: %w", dir, err)
		}
		if err := os.Chmod(dir, 0o755); err != nil {
			return nil, err
		}
	}
	if out, err := c.run("initdb", "-D", filepath.Join(dir, "data"), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8", "--locale=C"); err != nil {
		return nil, fmt.Errorf("initdb: %w: %s", err, out)
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	c.Port = port
	if err := c.Start(); err != nil {
		return nil, err
	}
	if err := c.reap(); err != nil {
		return nil, errors.Join(fmt.Errorf("start the cluster's reaper: %w", err), c.Destroy())
	}
	return c, nil
}

// reap starts a process that stops the server and removes its directory
// once this process has exited, however it exits (a panic, a test's
// timeout, SIGKILL), so that a test binary that dies does not leave a
// server running: a shell reads a pipe that only this process holds open
// (descriptors are not inherited by other children), and sees its end when
// the kernel closes it. It runs in a process group of its own, out of reach
// of a terminal's Ctrl-C to this one. The Cluster must stay reachable while
// its server is used: the pipe's file would otherwise be closed when it is
// collected.
func (c *Cluster) reap() error {
	stop := c.command("pg_ctl", "-D", filepath.Join(c.Dir, "data"), "-m", "immediate", "-w", "stop")
	cmd := exec.Command("/bin/sh", append([]string{"-c", `cat >/dev/null; dir=$1; shift; "$@" >/dev/null 2>&1; rm -rf "$dir"`, "pgtest-reaper", c.Dir}, stop.Args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	w, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	go func() { _ = cmd.Wait() }() // once Destroy closed the pipe, or never
	c.reaper = w
	return nil
}

// Start starts (or restarts after Stop) the cluster's server.
func (c *Cluster) Start() error {
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300 %s", c.Port, c.Dir, c.extra)
	out, err := c.run("pg_ctl", "-D", filepath.Join(c.Dir, "data"), "-l", filepath.Join(c.Dir, "server.log"), "-o", opts, "-w", "-t", "60", "start")
	if err != nil {
		log, _ := os.ReadFile(filepath.Join(c.Dir, "server.log"))
		return fmt.Errorf("pg_ctl start: %w: %s\n%s", err, out, log)
	}
	return nil
}

// Stop stops the server with a fast shutdown, keeping the data directory.
func (c *Cluster) Stop() error {
	out, err := c.run("pg_ctl", "-D", filepath.Join(c.Dir, "data"), "-m", "fast", "-w", "stop")
	if err != nil {
		return fmt.Errorf("pg_ctl stop: %w: %s", err, out)
	}
	return nil
}

// Destroy stops the server and removes its directory.
func (c *Cluster) Destroy() error {
	err := c.Stop()
	err = errors.Join(err, os.RemoveAll(c.Dir))
	if c.reaper != nil {
		err = errors.Join(err, c.reaper.Close()) // the reaper finds nothing left
	}
	return err
}

func (c *Cluster) run(tool string, args ...string) ([]byte, error) {
	return c.command(tool, args...).CombinedOutput()
}

// command runs one of the server's tools as the cluster's user.
func (c *Cluster) command(tool string, args ...string) *exec.Cmd {
	path := filepath.Join(c.bin, tool)
	if c.user != "" {
		return exec.Command("runuser", append([]string{"-u", c.user, "--", path}, args...)...)
	}
	return exec.Command(path, args...)
}

func startLocal() (*Server, error) {
	c, err := StartCluster()
	if err != nil {
		return nil, err
	}
	return &Server{URL: c.URL(), Source: "local binaries", stop: c.Destroy}, nil
}

// startContainer runs cmd/pgcontainer (testcontainers-go, in the tooling
// module, so the library's module graph holds no Docker client) and reads
// the URL it prints; closing its standard input stops the container.
func startContainer() (*Server, error) {
	if !dockerAnswers() {
		return nil, errors.New("no Docker engine answers (DOCKER_HOST unset and /var/run/docker.sock missing)")
	}
	cmd := exec.Command("go", "run", "github.com/dedupactivity/dedupactivity/cmd/pgcontainer")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("go run cmd/pgcontainer: %w", err)
	}
	url, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		_ = stdin.Close()
		return nil, errors.Join(fmt.Errorf("cmd/pgcontainer: %w", err), cmd.Wait())
	}
	return &Server{URL: strings.TrimSpace(url), Source: "testcontainers", stop: func() error {
		_ = stdin.Close()
		return cmd.Wait()
	}}, nil
}

func dockerAnswers() bool {
	if os.Getenv("DOCKER_HOST") != "" {
		return true
	}
	conn, err := net.DialTimeout("unix", "/var/run/docker.sock", time.Second)
	if err != nil {
		return false
	}
	conn.Close()
	return true
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// RolePool creates the login role role, runs grants (SQL in which %[1]s is
// the schema's quoted name and %[2]s the role's), and returns a pool that
// connects as that role with search_path set to the schema. The role and
// what it owns are dropped when the test ends.
func (s *Schema) RolePool(tb testing.TB, role, grants string) *pgxpool.Pool {
	tb.Helper()
	ctx := context.Background()
	r := pgx.Identifier{role}.Sanitize()
	sql := fmt.Sprintf(`CREATE ROLE %[2]s LOGIN PASSWORD 'pw';`+"\n"+grants, pgx.Identifier{s.Name}.Sanitize(), r)
	if _, err := s.Pool.Exec(ctx, sql); err != nil {
		tb.Fatalf("pgtest: create role %s: %v", role, err)
	}
	tb.Cleanup(func() {
		_, _ = s.Pool.Exec(context.Background(), fmt.Sprintf(`DROP OWNED BY %[1]s; DROP ROLE %[1]s`, r))
	})
	cfg, err := pgxpool.ParseConfig(s.URL)
	if err != nil {
		tb.Fatalf("pgtest: parse url: %v", err)
	}
	cfg.ConnConfig.User, cfg.ConnConfig.Password = role, "pw"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		tb.Fatalf("pgtest: pool of role %s: %v", role, err)
	}
	tb.Cleanup(pool.Close)
	return pool
}
