package pgtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PgBouncer is a PgBouncer process in transaction pooling mode in front of a
// PostgreSQL server, started from the local binary (Debian's package puts it
// in /usr/sbin) in a temporary directory of its own.
type PgBouncer struct {
	// Dir holds the configuration, the log and the pid file.
	Dir string
	// Port is the port PgBouncer listens on, on 127.0.0.1.
	Port int
	// URL connects through PgBouncer to the server's database. PgBouncer
	// logs in to the server as the server URL's user whatever user the
	// client names (auth_type = any).
	URL string
	// Version is the binary's version, e.g. "1.18.0".
	Version string

	cmd    *exec.Cmd
	done   chan struct{} // closed when the process has exited
	stderr *bytes.Buffer // read only after done is closed
}

// PgBouncerBin finds the pgbouncer binary: PGBOUNCER if set, then PATH, then
// /usr/sbin/pgbouncer (not on a non-root user's PATH on Debian).
func PgBouncerBin() (string, error) {
	if p := os.Getenv("PGBOUNCER"); p != "" {
		return p, nil
	}
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	if _, err := os.Stat("/usr/sbin/pgbouncer"); err == nil {
		return "/usr/sbin/pgbouncer", nil
	}
	return "", errors.New("pgbouncer not found (PGBOUNCER, PATH, /usr/sbin/pgbouncer); install it with apt-get install pgbouncer")
}

// NewPgBouncer starts a PgBouncer in front of the process-wide test server
// (see [Start]), stopped when the test ends. settings are extra "key = value"
// lines for the [pgbouncer] section, written after the defaults so they
// override them (e.g. "default_pool_size = 1"). Without the pgbouncer binary
// (or without a server) it fails under CI=true and skips elsewhere.
//
// The defaults: pool_mode = transaction, listen_addr = 127.0.0.1 on a free
// port, no Unix socket, auth_type = any (the client's user name is ignored;
// every database entry logs in as the server URL's user and password),
// default_pool_size = 20, max_client_conn = 500, and on PgBouncer 1.21 and
// later max_prepared_statements = 0, so every version behaves like the 1.18
// of Debian 12: named prepared statements are not tracked across server
// connections.
func NewPgBouncer(tb testing.TB, settings ...string) *PgBouncer {
	tb.Helper()
	s := RequireServer(tb)
	p, err := StartPgBouncer(s.URL, settings...)
	if err != nil {
		if os.Getenv("CI") == "true" {
			tb.Fatalf("pgtest: start PgBouncer (required under CI=true): %v", err)
		}
		tb.Skipf("pgtest: cannot start PgBouncer, skipping (apt-get install pgbouncer, or set PGBOUNCER): %v", err)
	}
	tb.Cleanup(func() {
		if err := p.Stop(); err != nil {
			tb.Errorf("pgtest: %v", err)
		}
	})
	return p
}

// StartPgBouncer starts a PgBouncer in front of the server at serverURL; see
// [NewPgBouncer] for the configuration. The caller stops it with Stop.
func StartPgBouncer(serverURL string, settings ...string) (*PgBouncer, error) {
	bin, err := PgBouncerBin()
	if err != nil {
		return nil, err
	}
	version, err := pgbouncerVersion(bin)
	if err != nil {
		return nil, err
	}
	defaults := ""
	if versionAtLeast(version, 1, 21) {
		defaults = "max_prepared_statements = 0\n"
	}
	cfg, err := pgx.ParseConfig(serverURL)
	if err != nil {
		return nil, fmt.Errorf("parse server url: %w", err)
	}
	// Every database name maps to the database of that name on the server,
	// logged in to as the server URL's user.
	target := fmt.Sprintf("host=%s port=%d user=%s", iniValue(cfg.Host), cfg.Port, iniValue(cfg.User))
	if cfg.Password != "" {
		target += " password=" + iniValue(cfg.Password)
	}

	dir, err := os.MkdirTemp("", "pgbouncer-")
	if err != nil {
		return nil, err
	}
	var args []string
	if os.Geteuid() == 0 {
		// PgBouncer refuses to run as root ("PgBouncer should not run as
		// root"); -u makes it switch to the postgres user, which must be
		// able to write its directory.
		if _, err := user.Lookup("postgres"); err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("running as root and no postgres user: %w", err)
		}
		if out, err := exec.Command("chown", "-R", "postgres", dir).CombinedOutput(); err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("chown %s: %w: %s", dir, err, out)
		}
		args = append(args, "-u", "postgres")
	}

	// The port was free a moment ago; if another process takes it first,
	// PgBouncer exits and we try another.
	var errs []error
	for range 3 {
		port, err := FreePort()
		if err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		p := &PgBouncer{Dir: dir, Port: port, URL: bouncerURL(port, cfg.User, cfg.Database), Version: version}
		ini := fmt.Sprintf(`[databases]
* = %s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = any
pool_mode = transaction
default_pool_size = 20
max_client_conn = 500
logfile = %s
pidfile = %s
%s%s
`, target, port, p.LogPath(), filepath.Join(dir, "pgbouncer.pid"), defaults, strings.Join(settings, "\n"))
		conf := filepath.Join(dir, "pgbouncer.ini")
		if err := os.WriteFile(conf, []byte(ini), 0o644); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		if err := p.start(bin, append(args, conf)); err != nil {
			errs = append(errs, err)
			continue
		}
		return p, nil
	}
	os.RemoveAll(dir)
	return nil, errors.Join(errs...)
}

// LogPath is PgBouncer's log file.
func (p *PgBouncer) LogPath() string { return filepath.Join(p.Dir, "pgbouncer.log") }

func (p *PgBouncer) start(bin string, args []string) error {
	p.cmd = exec.Command(bin, args...)
	p.stderr = new(bytes.Buffer)
	p.cmd.Stderr = p.stderr
	if err := p.cmd.Start(); err != nil {
		return fmt.Errorf("start pgbouncer: %w", err)
	}
	p.done = make(chan struct{})
	go func() {
		_ = p.cmd.Wait()
		close(p.done)
	}()
	deadline := time.Now().Add(15 * time.Second)
	for {
		select {
		case <-p.done:
			return fmt.Errorf("pgbouncer exited: %s\n%s", p.cmd.ProcessState, p.stderr)
		default:
		}
		if c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p.Port)), time.Second); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			_ = p.stop()
			return fmt.Errorf("pgbouncer did not listen on 127.0.0.1:%d within 15s", p.Port)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Listening is not enough: check that it reaches the server.
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, p.URL)
	if err == nil {
		_, err = conn.Exec(ctx, "SELECT 1", pgx.QueryExecModeSimpleProtocol)
		conn.Close(ctx)
	}
	if err != nil {
		_ = p.stop()
		log, _ := os.ReadFile(p.LogPath())
		return fmt.Errorf("query through pgbouncer: %w\n%s", err, log)
	}
	return nil
}

// Stop shuts PgBouncer down (immediate shutdown: open client connections
// are closed) and removes its directory.
func (p *PgBouncer) Stop() error {
	if p == nil || p.cmd == nil {
		return nil
	}
	err := p.stop()
	return errors.Join(err, os.RemoveAll(p.Dir))
}

func (p *PgBouncer) stop() error {
	select {
	case <-p.done:
		return nil
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return nil
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
		return errors.New("pgbouncer did not exit within 10s of SIGTERM; killed")
	}
}

// pgbouncerVersion runs bin --version, whose first line is "PgBouncer 1.18.0".
func pgbouncerVersion(bin string) (string, error) {
	out, err := exec.Command(bin, "--version").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s --version: %w: %s", bin, err, out)
	}
	first, _, _ := strings.Cut(string(out), "\n")
	v, ok := strings.CutPrefix(strings.TrimSpace(first), "PgBouncer ")
	if !ok {
		return "", fmt.Errorf("%s --version: unexpected output %q", bin, first)
	}
	return v, nil
}

// versionAtLeast says whether version ("1.18.0") is at least major.minor.
func versionAtLeast(version string, major, minor int) bool {
	parts := strings.SplitN(version, ".", 3)
	if len(parts) < 2 {
		return false
	}
	ma, _ := strconv.Atoi(parts[0])
	mi, _ := strconv.Atoi(parts[1])
	return ma > major || ma == major && mi >= minor
}

func bouncerURL(port int, usr, db string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User(usr),
		Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(port)),
		Path:     "/" + db,
		RawQuery: "sslmode=disable",
	}
	return u.String()
}

// iniValue quotes a connection-string value for PgBouncer's [databases]
// section.
func iniValue(s string) string {
	if s != "" && !strings.ContainsAny(s, " '\\\t\"=") {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}
