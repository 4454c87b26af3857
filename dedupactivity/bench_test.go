package dedupactivity_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// Go benchmarks of the claim against the test cluster (fsync off, so they
// show CPU and round-trip cost, not disk). cmd/bench (make bench) compares
// the approaches on a durable server.

func benchSetup(b *testing.B, opts dedupactivity.Options) *testBundle {
	b.Helper()
	return setupTB(b, opts)
}

func BenchmarkBare(b *testing.B) {
	tb := benchSetup(b, dedupactivity.Options{})
	ctx := context.Background()
	for b.Loop() {
		require.NoError(b, pgx.BeginFunc(ctx, tb.pool, func(tx pgx.Tx) error {
			_, err := tb.post(ctx, tx, Transfer{Account: "a", Amount: 1})
			return err
		}))
	}
}

func benchDo(b *testing.B, opts dedupactivity.Options, duplicate bool) {
	benchDoID(b, opts, func(key string) dedupactivity.Identity {
		if duplicate {
			key = "same"
		}
		return dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, ActivityType: "Post", Key: key}
	})
}

// benchDoID runs Do on the identity id makes of a new key each time.
func benchDoID(b *testing.B, opts dedupactivity.Options, id func(key string) dedupactivity.Identity) {
	tb := benchSetup(b, opts)
	ctx := context.Background()
	i := 0
	for b.Loop() {
		i++
		_, _, err := dedupactivity.Do(ctx, tb.d, id(fmt.Sprint(i)), Transfer{Account: "a", Amount: 1}, tb.post)
		require.NoError(b, err)
	}
}

func BenchmarkDo(b *testing.B) { benchDo(b, dedupactivity.Options{}, false) }
func BenchmarkDoDiscardResults(b *testing.B) {
	benchDo(b, dedupactivity.Options{DiscardResults: true}, false)
}
func BenchmarkDoDuplicate(b *testing.B) { benchDo(b, dedupactivity.Options{}, true) }

// BenchmarkDoRunScoped claims a run-scoped identity's first attempt, whose
// claim rides with the effect's first statement as a wrapped activity's
// does, and decodes the result it stored, as a wrapped activity does too.
func BenchmarkDoRunScoped(b *testing.B) {
	benchDoID(b, dedupactivity.Options{}, func(key string) dedupactivity.Identity {
		return dedupactivity.Identity{Kind: dedupactivity.KindActivity, Namespace: "default", WorkflowID: "w-" + key, RunID: "r", ActivityID: "1"}
	})
}
