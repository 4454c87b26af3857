package dedupactivity_test

import (
	"context"
	"crypto/sha256"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// TestAnyTextStoredAsSent: identities and activity types holding quotes,
// backslashes, dollar quotes, NUL or invalid UTF-8 claim exactly one event
// each, under the SHA-256 of the identity's exact bytes, and the activity
// type is stored as it is (bytes text cannot hold become U+FFFD).
func TestAnyTextStoredAsSent(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	ctx := context.Background()
	cases := map[string]string{ // activity type sent -> stored
		`it's`:                       `it's`,
		`back\slash`:                 `back\slash`,
		`\'); DROP TABLE ledger; --`: `\'); DROP TABLE ledger; --`,
		`E'\\x00' $$ $tag$ "q"`:      `E'\\x00' $$ $tag$ "q"`,
		"nul\x00byte":                "nul\uFFFDbyte",
		"bad\xffutf8":                "bad\uFFFDutf8",
		"naïve ✓ 日本":                 "naïve ✓ 日本",
		"trailing backslash \\":      "trailing backslash \\",
		"line\nbreak\ttab\r":         "line\nbreak\ttab\r",
		"quote at end '":             "quote at end '",
		"''":                         "''",
	}
	for sent, want := range cases {
		id := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: sent, ActivityType: sent, Key: sent}
		in := Transfer{Account: "a", Amount: 1}
		_, outcome, err := dedupactivity.Do(ctx, b.d, id, in, b.post)
		require.NoError(t, err, "%q", sent)
		require.Equal(t, dedupactivity.OutcomeClaimed, outcome, "%q", sent)
		_, outcome, err = dedupactivity.Do(ctx, b.d, id, in, b.post)
		require.NoError(t, err, "%q", sent)
		require.Equal(t, dedupactivity.OutcomeDuplicate, outcome, "%q", sent)

		var typ string
		h := sha256.Sum256(id.Encode())
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT activity_type FROM dedup_marker WHERE id_hash = $1`, h[:]).Scan(&typ))
		require.Equal(t, want, typ, "%q", sent)
	}
	require.Equal(t, int64(len(cases)), b.ledgerRows(t))
	require.Equal(t, int64(len(cases)), b.markers(t))
}
