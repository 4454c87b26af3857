#!/usr/bin/env bash
# Instructions per event, client and server, for bench rows, counted by
# valgrind's callgrind: the same count for the same binaries and inputs
# whatever else the machine is doing, so two versions of the library, or two
# SQL shapes, compare on a shared, noisy machine where throughput cannot
# tell a few percent apart. Kernel time (system calls, the loopback network)
# is not counted: round trips cost more than this shows.
#
# Usage: cmd/bench/instructions.sh ["row;row;..."]   (default: the core rows)
# Needs valgrind (Debian: apt-get install valgrind) and the PostgreSQL server
# binaries (make deps). Runs as root or as a user that can run initdb.
set -euo pipefail
cd "$(dirname "$0")/../.."

rows=${1:-"bare;seed recipe (plain pgx);dedupactivity;dedupactivity, business key;by hand: dedupactivity's SQL"}
small=${SMALL:-200}
large=${LARGE:-1200}

command -v valgrind >/dev/null || { echo "valgrind is missing: apt-get install valgrind" >&2; exit 1; }
bindir=${PG_BINDIR:-$(dirname "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb | tail -n 1)")}
tmp=$(mktemp -d)
port=$((20000 + RANDOM % 20000))
as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -c "$*"; else bash -c "$*"; fi; }
[ "$(id -u)" = 0 ] && chown postgres "$tmp"
cleanup() { pkill -f -- "-D $tmp/data" 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT

go build -o "$tmp/bench" ./cmd/bench
as_pg "$bindir/initdb -D $tmp/data -U postgres -A trust --no-sync -E UTF8 --locale=C >/dev/null"
mkdir -p "$tmp/server" && { [ "$(id -u)" != 0 ] || chown postgres "$tmp/server"; }
# The server under callgrind: every backend writes its count when it exits.
as_pg "nohup valgrind --tool=callgrind --callgrind-out-file=$tmp/server/cg.%p $bindir/postgres -D $tmp/data -p $port -k $tmp \
  -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c autovacuum=off -c shared_buffers=256MB >$tmp/server.log 2>&1 &"
for _ in $(seq 120); do psql -h 127.0.0.1 -p "$port" -U postgres -Atqc 'SELECT 1' >/dev/null 2>&1 && break; sleep 1; done

# count ROW N: prints "client server allocations" for N serial events.
count() {
  local db="ic$RANDOM$RANDOM" before after client server=0 f allocs
  psql -h 127.0.0.1 -p "$port" -U postgres -qc "CREATE DATABASE $db"
  sleep 2 # the CREATE's backend writes its count
  before=$(ls "$tmp/server")
  BENCH_DATABASE_URL="postgres://postgres@127.0.0.1:$port/$db" GODEBUG=asyncpreemptoff=1 GOMAXPROCS=1 \
    valgrind --tool=callgrind --callgrind-out-file="$tmp/client.out" "$tmp/bench" -only "$1" -serial "$2" -temporal=false \
    >"$tmp/client.stdout" 2>"$tmp/client.stderr"
  sleep 3 # the client's backends exit
  after=$(ls "$tmp/server")
  client=$(sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$tmp/client.stderr")
  for f in $(comm -13 <(echo "$before") <(echo "$after")); do
    server=$((server + $(awk '/^summary:/ {print $2; exit}' "$tmp/server/$f")))
  done
  allocs=$(sed -n 's/.*events, \([0-9.]*\) allocations.*/\1/p' "$tmp/client.stdout")
  psql -h 127.0.0.1 -p "$port" -U postgres -qc "DROP DATABASE $db"
  echo "$client $server $allocs"
}

printf '| row | client instructions/event | server instructions/event | total | client allocations/event |\n|---|---:|---:|---:|---:|\n'
IFS=';' read -ra list <<<"$rows"
for row in "${list[@]}"; do
  read -r c1 s1 _ <<<"$(count "$row" "$small")"
  read -r c2 s2 a2 <<<"$(count "$row" "$large")"
  n=$((large - small))
  c=$(((c2 - c1) / n)) s=$(((s2 - s1) / n))
  printf '| %s | %d | %d | %d | %s |\n' "$row" "$c" "$s" $((c + s)) "$a2"
done
echo
echo "(callgrind, $small and $large serial events per row, the difference divided by $((large - small)); PostgreSQL $("$bindir/postgres" --version | awk '{print $3}'), $(go version | awk '{print $3}'))"
