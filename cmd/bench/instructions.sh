#!/usr/bin/env bash
# Instructions per event, client and server, for bench rows, counted by
# valgrind's callgrind: a count that does not follow what else the machine
# is doing (the server's repeats; the client's, see below, over RUNS), so two
# versions of the library, or two SQL shapes, compare on a shared, noisy
# machine where throughput cannot tell a few percent apart. Kernel time
# (system calls, the loopback network) is not counted: round trips cost more
# than this shows.
#
# Usage: cmd/bench/instructions.sh ["row;row;..."]   (default: the core rows)
# Each row runs SMALL and then LARGE serial events (cmd/bench -serial; default
# 500 and 2500) twice: the client under callgrind against a plain server,
# then the client plain against a server under callgrind; the counts'
# difference over LARGE-SMALL is the cost per event, warm-up and setup left
# out. RUNS (default 1) repeats that per row and prints the smallest client
# and the smallest server count (their total may mix two runs), and each
# range; the allocations are the last run's (they repeat).
#
# The server's count repeats within about 0.5%. The client's moves by up to
# about 15% between runs of the same binary (57.1k to 65.4k per event): the Go runtime's scheduler and
# sysmon do work per unit of time (handing the P over around system calls,
# looking for work), and callgrind slows the client some 50 times, by an
# amount that varies with the machine. That work is not per event, so the
# smallest of several runs is the closest to the client's cost; compare
# client counts over RUNS=3 or more, and allocations, which repeat.
# What the server's count holds: the backends that exit, which is every
# connection of the bench process (the pool closes them at exit; settled
# waits for them). The postmaster, checkpointer, background writer and WAL
# writer never exit, so no row's count has them; with synchronous_commit
# off (both servers) the WAL writer writes and flushes the WAL the backends
# insert, so a row that writes more WAL has that part of its cost, mostly
# kernel time, left out, and the counts are not those of the throughput
# bench's synchronous_commit=on commits. autovacuum is off on both servers,
# so no worker lands in one run and not another. Valgrind's callgrind
# (3.19 at least) starts a forked process with its parent's count so far:
# each backend's file holds the postmaster's instructions up to its fork.
# That cancels in LARGE-SMALL while both runs open the same number of
# connections (the server's count repeating within 0.5% says they do); what
# is left is the postmaster's own work between the two runs' forks
# (accepting the connections in between), times the backends, alike for
# every row.
# Needs valgrind (Debian: apt-get install valgrind) and the PostgreSQL server
# binaries (make deps). Runs as root (the server as user postgres) or as a
# user that can run initdb.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/../.."
export GOTOOLCHAIN=${GOTOOLCHAIN:-go1.27.3} # as the Makefile: the counts depend on the toolchain

rows=${1:-"bare;seed recipe (plain pgx);dedupactivity;dedupactivity, business key;by hand: dedupactivity's SQL"}
small=${SMALL:-500}
large=${LARGE:-2500}
runs=${RUNS:-1}
[[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "RUNS must be a positive integer, not '$runs'" >&2; exit 1; }

command -v valgrind >/dev/null || { echo "valgrind is missing: apt-get install valgrind" >&2; exit 1; }
bindir=${PG_BINDIR:-$(dirname "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb | tail -n 1)")}
psql="$bindir/psql"
[ -x "$psql" ] || psql=psql
tmp=$(mktemp -d)
as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -c "$*"; else bash -c "$*"; fi; }
[ "$(id -u)" = 0 ] && chown postgres "$tmp"
# Two servers, each on a socket in tmp only, so nothing else can be reached
# by mistake: one under callgrind to count the server's instructions, one
# plain, so that the client is counted against a server at full speed (a
# slow server would have the client's runtime spin and schedule more).
sql() { "$psql" -h "$tmp" -p "$1" -U postgres -Atqc "$2"; }
cleanup() {
  for d in cg plain; do
    [ -f "$tmp/$d/postmaster.pid" ] && as_pg "$bindir/pg_ctl -D $tmp/$d -m fast -w -t 120 stop" >/dev/null 2>&1
  done
  # valgrind writes the last counts after the pid file is gone.
  for _ in $(seq 60); do pgrep -f -- "-D $tmp/" >/dev/null || break; sleep 0.5; done
  rm -rf "$tmp"
}
trap cleanup EXIT

go build -o "$tmp/bench" ./cmd/bench
opts="-c listen_addresses= -c fsync=off -c synchronous_commit=off -c autovacuum=off -c shared_buffers=256MB"
for d in cg plain; do
  as_pg "$bindir/initdb -D $tmp/$d -U postgres -A trust --no-sync -E UTF8 --locale=C >/dev/null"
done
mkdir -p "$tmp/server" && { [ "$(id -u)" != 0 ] || chown postgres "$tmp/server"; }
# Under callgrind every backend writes its count when it exits.
as_pg "nohup valgrind --tool=callgrind --callgrind-out-file=$tmp/server/cg.%p $bindir/postgres -D $tmp/cg -p 5432 -k $tmp $opts >$tmp/cg.log 2>&1 &"
as_pg "$bindir/pg_ctl -D $tmp/plain -l $tmp/plain.log -w -o '-p 5433 -k $tmp $opts' start >/dev/null"
for _ in $(seq 120); do sql 5432 'SELECT 1' >/dev/null 2>&1 && break; sleep 1; done
sql 5432 'SELECT 1' >/dev/null || { echo "PostgreSQL under valgrind did not start:" >&2; cat "$tmp/cg.log" >&2; exit 1; }

# The postmaster's children when idle (its own processes); a backend that
# exits has written its count.
pm=$(head -n 1 "$tmp/cg/postmaster.pid")
children() { pgrep -P "$pm" | wc -l; }
sleep 5
idle=$(children)

# settled waits until every backend of the server under callgrind has
# exited, its count written, with no query of its own (a psql backend would
# count itself in).
settled() {
  local calm=0
  for _ in $(seq 240); do
    if [ "$(children)" -le "$idle" ]; then
      calm=$((calm + 1))
      [ "$calm" -ge 2 ] && return 0
    else
      calm=0
    fi
    sleep 0.5
  done
  echo "the server's backends did not exit" >&2
  return 1
}

# bench PORT ROW N [valgrind...]: N serial events of ROW against the server
# on PORT, in a new database.
bench() {
  local port=$1 row=$2 n=$3 db="ic$RANDOM$RANDOM"
  shift 3
  sql "$port" "CREATE DATABASE $db" >/dev/null
  [ "$port" != 5432 ] || settled
  ls "$tmp/server" >"$tmp/before"
  if ! BENCH_DATABASE_URL="postgres://postgres@/$db?host=$tmp&port=$port" GODEBUG=asyncpreemptoff=1 GOMAXPROCS=1 "$@" "$tmp/bench" -only "$row" -serial "$n" -temporal=false >"$tmp/client.stdout" 2>"$tmp/client.stderr"; then
    echo "bench -only '$row' -serial $n failed:" >&2
    grep -v '^==' "$tmp/client.stderr" >&2 || true
    return 1
  fi
  [ "$port" != 5432 ] || settled
  ls "$tmp/server" >"$tmp/after"
  sql "$port" "DROP DATABASE $db" >/dev/null
}

# count ROW N: prints "client server allocations" for N serial events.
count() {
  local client server=0 f allocs
  bench 5433 "$1" "$2" valgrind --tool=callgrind --callgrind-out-file="$tmp/client.out"
  client=$(sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$tmp/client.stderr")
  allocs=$(sed -n 's/.*events, \([0-9.]*\) allocations.*/\1/p' "$tmp/client.stdout")
  bench 5432 "$1" "$2"
  for f in $(comm -13 "$tmp/before" "$tmp/after"); do
    server=$((server + $(awk '/^summary:/ {print $2; exit}' "$tmp/server/$f")))
  done
  [ -n "$client" ] && [ "$server" -gt 0 ] && [ -n "$allocs" ] || { echo "no counts for '$1'" >&2; return 1; }
  echo "$client $server $allocs"
}

printf '| row | client instructions/event | server instructions/event | total | client allocations/event | client range | server range |\n|---|---:|---:|---:|---:|---:|---:|\n'
IFS=';' read -ra list <<<"$rows"
n=$((large - small))
for row in "${list[@]}"; do
  cs=() ss=()
  for _ in $(seq "$runs"); do
    first=$(count "$row" "$small")
    second=$(count "$row" "$large")
    read -r c1 s1 _ <<<"$first"
    read -r c2 s2 a2 <<<"$second"
    cs+=("$(((c2 - c1) / n))") ss+=("$(((s2 - s1) / n))")
  done
  # The first and last of the sorted counts (one run: the same line twice).
  read -r cmin cmax < <(printf '%s\n' "${cs[@]}" | sort -n | sed -n '1p;$p' | paste -sd' ')
  read -r smin smax < <(printf '%s\n' "${ss[@]}" | sort -n | sed -n '1p;$p' | paste -sd' ')
  printf '| %s | %d | %d | %d | %s | %d-%d | %d-%d |\n' "$row" "$cmin" "$smin" $((cmin + smin)) "$a2" "$cmin" "$cmax" "$smin" "$smax"
done
echo
echo "(callgrind: $small and $large serial events per row, client and server counted in separate runs, the difference divided by $n; the smallest client and server counts of $runs run(s) per row, and their ranges; PostgreSQL $("$bindir/postgres" --version | awk '{print $3}'), $(go version | awk '{print $3}'))"
