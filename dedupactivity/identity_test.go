package dedupactivity_test

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/activity"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

func info(mut func(*activity.Info)) activity.Info {
	i := activity.Info{Namespace: "default", ActivityID: "5", Attempt: 1}
	i.WorkflowExecution.ID = "wf"
	i.WorkflowExecution.RunID = "run-1"
	i.ActivityType.Name = "Debit"
	if mut != nil {
		mut(&i)
	}
	return i
}

func TestIdentityFromInfo(t *testing.T) {
	t.Parallel()

	base := dedupactivity.IdentityFromInfo(info(nil))
	require.Equal(t, dedupactivity.KindActivity, base.Kind)

	t.Run("AttemptsShareIdentity", func(t *testing.T) {
		t.Parallel()
		retry := dedupactivity.IdentityFromInfo(info(func(i *activity.Info) { i.Attempt = 7 }))
		require.Equal(t, base.Encode(), retry.Encode())
	})
	t.Run("NewRunIsNewEvent", func(t *testing.T) {
		t.Parallel()
		// Continue-as-new, workflow retry, cron and reset reuse activity IDs
		// under a new run ID.
		next := dedupactivity.IdentityFromInfo(info(func(i *activity.Info) { i.WorkflowExecution.RunID = "run-2" }))
		require.NotEqual(t, base.Encode(), next.Encode())
	})
	t.Run("LocalActivityDoesNotCollide", func(t *testing.T) {
		t.Parallel()
		local := dedupactivity.IdentityFromInfo(info(func(i *activity.Info) { i.IsLocalActivity = true }))
		require.Equal(t, dedupactivity.KindLocalActivity, local.Kind)
		require.NotEqual(t, base.Encode(), local.Encode())
	})
	t.Run("Standalone", func(t *testing.T) {
		t.Parallel()
		sa := dedupactivity.IdentityFromInfo(info(func(i *activity.Info) {
			i.WorkflowExecution.ID, i.WorkflowExecution.RunID, i.ActivityRunID = "", "", "arun-1"
		}))
		require.Equal(t, dedupactivity.KindStandalone, sa.Kind)
		sa2 := dedupactivity.IdentityFromInfo(info(func(i *activity.Info) {
			i.WorkflowExecution.ID, i.WorkflowExecution.RunID, i.ActivityRunID = "", "", "arun-2"
		}))
		require.NotEqual(t, sa.Encode(), sa2.Encode())
	})
}

func TestIdentityEncodeIsInjective(t *testing.T) {
	t.Parallel()
	// Field boundaries cannot be shifted: "ab"+"c" differs from "a"+"bc".
	a := dedupactivity.Identity{Kind: dedupactivity.KindActivity, Namespace: "ns", WorkflowID: "ab", RunID: "c", ActivityID: "1"}
	b := dedupactivity.Identity{Kind: dedupactivity.KindActivity, Namespace: "ns", WorkflowID: "a", RunID: "bc", ActivityID: "1"}
	require.NotEqual(t, a.Encode(), b.Encode())

	// NUL bytes and invalid UTF-8 are kept as they are.
	nul := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "ns", ActivityType: "T", Key: "a\x00b"}
	bad := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "ns", ActivityType: "T", Key: "a\xffb"}
	require.True(t, bytes.Contains(nul.Encode(), []byte("a\x00b")))
	require.True(t, bytes.Contains(bad.Encode(), []byte("a\xffb")))
	require.NotEqual(t, nul.Hash(), bad.Hash())

	// Kinds never collide even with identical field values.
	k := dedupactivity.Identity{Kind: dedupactivity.KindLocalActivity, Namespace: "ns", WorkflowID: "ab", RunID: "c", ActivityID: "1"}
	require.NotEqual(t, a.Encode(), k.Encode())

	long := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Key: strings.Repeat("x", 10000)}
	require.Len(t, long.Hash(), 32)
}

func TestFingerprint(t *testing.T) {
	t.Parallel()
	a1, err := dedupactivity.Fingerprint(Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	a2, err := dedupactivity.Fingerprint(Transfer{Account: "a", Amount: 1})
	require.NoError(t, err)
	b, err := dedupactivity.Fingerprint(Transfer{Account: "a", Amount: 2})
	require.NoError(t, err)
	require.Equal(t, a1, a2)
	require.NotEqual(t, a1, b)

	_, err = dedupactivity.Fingerprint(func() {})
	require.ErrorIs(t, err, dedupactivity.ErrEncoding)
}
