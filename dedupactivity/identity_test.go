package dedupactivity_test

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	commonpb "go.temporal.io/api/common/v1"
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

// TestIdentityEncodesEveryFieldOfItsKind: changing any one field an
// identity's kind is scoped to (README, Event identity) changes its
// encoding and hash, so two events that differ only there are never taken
// for one; a field of another kind is ignored, as Identity documents.
func TestIdentityEncodesEveryFieldOfItsKind(t *testing.T) {
	t.Parallel()
	all := dedupactivity.Identity{Namespace: "ns", WorkflowID: "wf", RunID: "run", ActivityID: "1", ActivityRunID: "arun", ActivityType: "Post", Key: "k"}
	set := map[string]func(*dedupactivity.Identity){
		"Namespace":     func(id *dedupactivity.Identity) { id.Namespace = "other" },
		"WorkflowID":    func(id *dedupactivity.Identity) { id.WorkflowID = "other" },
		"RunID":         func(id *dedupactivity.Identity) { id.RunID = "other" },
		"ActivityID":    func(id *dedupactivity.Identity) { id.ActivityID = "other" },
		"ActivityRunID": func(id *dedupactivity.Identity) { id.ActivityRunID = "other" },
		"ActivityType":  func(id *dedupactivity.Identity) { id.ActivityType = "other" },
		"Key":           func(id *dedupactivity.Identity) { id.Key = "other" },
	}
	scoped := map[dedupactivity.Kind][]string{
		dedupactivity.KindActivity:      {"Namespace", "WorkflowID", "RunID", "ActivityID"},
		dedupactivity.KindLocalActivity: {"Namespace", "WorkflowID", "RunID", "ActivityID"},
		dedupactivity.KindStandalone:    {"Namespace", "ActivityID", "ActivityRunID"},
		dedupactivity.KindBusinessKey:   {"Namespace", "ActivityType", "Key"},
	}
	for kind, fields := range scoped {
		base := all
		base.Kind = kind
		for name, mut := range set {
			changed := base
			mut(&changed)
			if slices.Contains(fields, name) {
				require.NotEqual(t, base.Encode(), changed.Encode(), "%s identity: %s is part of it", kind, name)
				require.NotEqual(t, base.Hash(), changed.Hash(), "%s identity: %s is part of it", kind, name)
			} else {
				require.Equal(t, base.Encode(), changed.Encode(), "%s identity: %s is not part of it", kind, name)
			}
		}
	}
}

// TestIdentityFromInfoTakesEachField: the run-scoped identity of an
// activity attempt is built from the info's own fields, each in its place:
// a regular and a local activity's namespace, workflow ID, run ID and
// activity ID; a standalone activity's namespace, activity ID and activity
// run ID.
func TestIdentityFromInfoTakesEachField(t *testing.T) {
	t.Parallel()
	i := activity.Info{Namespace: "ns", ActivityID: "7", ActivityRunID: "arun", Attempt: 3}
	i.WorkflowExecution.ID, i.WorkflowExecution.RunID, i.ActivityType.Name = "wf", "run", "Debit"
	require.Equal(t, dedupactivity.Identity{Kind: dedupactivity.KindActivity, Namespace: "ns", WorkflowID: "wf", RunID: "run", ActivityID: "7"},
		dedupactivity.IdentityFromInfo(i))
	local := i
	local.IsLocalActivity = true
	require.Equal(t, dedupactivity.Identity{Kind: dedupactivity.KindLocalActivity, Namespace: "ns", WorkflowID: "wf", RunID: "run", ActivityID: "7"},
		dedupactivity.IdentityFromInfo(local))
	standalone := i
	standalone.WorkflowExecution.ID, standalone.WorkflowExecution.RunID = "", ""
	require.Equal(t, dedupactivity.Identity{Kind: dedupactivity.KindStandalone, Namespace: "ns", ActivityID: "7", ActivityRunID: "arun"},
		dedupactivity.IdentityFromInfo(standalone))
}

// refusedIdentity is an identity Do refuses, and the error it refuses it with.
type refusedIdentity struct {
	id   dedupactivity.Identity
	want error
}

// TestIdentityNeedsEveryFieldOfItsKind: an identity given to Do that
// lacks a field its kind needs is refused with ErrInvalidIdentity (an empty
// business key with ErrEmptyBusinessKey) and applies nothing; counted with
// SQL.
func TestIdentityNeedsEveryFieldOfItsKind(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	run := dedupactivity.Identity{Kind: dedupactivity.KindActivity, Namespace: "ns", WorkflowID: "wf", RunID: "run", ActivityID: "1"}
	standalone := dedupactivity.Identity{Kind: dedupactivity.KindStandalone, Namespace: "ns", ActivityID: "1", ActivityRunID: "arun"}
	keyed := dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "ns", ActivityType: "Post", Key: "k"}
	cases := map[string]refusedIdentity{}
	for name, clear := range map[string]func(*dedupactivity.Identity){
		"WorkflowID": func(id *dedupactivity.Identity) { id.WorkflowID = "" },
		"RunID":      func(id *dedupactivity.Identity) { id.RunID = "" },
		"ActivityID": func(id *dedupactivity.Identity) { id.ActivityID = "" },
	} {
		for _, kind := range []dedupactivity.Kind{dedupactivity.KindActivity, dedupactivity.KindLocalActivity} {
			id := run
			id.Kind = kind
			clear(&id)
			cases[fmt.Sprint(kind, "/", name)] = refusedIdentity{id, dedupactivity.ErrInvalidIdentity}
		}
	}
	noID, noRun := standalone, standalone
	noID.ActivityID, noRun.ActivityRunID = "", ""
	noKey := keyed
	noKey.Key = ""
	cases["standalone/ActivityID"] = refusedIdentity{noID, dedupactivity.ErrInvalidIdentity}
	cases["standalone/ActivityRunID"] = refusedIdentity{noRun, dedupactivity.ErrInvalidIdentity}
	cases["business_key/Key"] = refusedIdentity{noKey, dedupactivity.ErrEmptyBusinessKey}
	for name, c := range cases {
		_, _, err := dedupactivity.Do(context.Background(), b.d, c.id, Transfer{Account: "a", Amount: 1}, b.post)
		require.ErrorIs(t, err, c.want, name)
	}
	require.Zero(t, b.markers(t))
	require.Zero(t, b.ledgerRows(t))

	for _, id := range []dedupactivity.Identity{run, standalone, keyed} {
		_, outcome, err := dedupactivity.Do(context.Background(), b.d, id, Transfer{Account: "a", Amount: 1}, b.post)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeClaimed, outcome, "complete: applied")
	}
}

// TestBusinessKeyScopedByNamespace: one business key and activity type in
// two namespaces are two events (applied twice, two markers), and so are
// two activity types in one namespace; the same of all three is one.
func TestBusinessKeyScopedByNamespace(t *testing.T) {
	t.Parallel()
	b := setup(t, dedupactivity.Options{})
	in := Transfer{Account: "a", Amount: 1}
	for _, id := range []dedupactivity.Identity{
		{Kind: dedupactivity.KindBusinessKey, Namespace: "ns-1", ActivityType: "Post", Key: "order-1"},
		{Kind: dedupactivity.KindBusinessKey, Namespace: "ns-2", ActivityType: "Post", Key: "order-1"},
		{Kind: dedupactivity.KindBusinessKey, Namespace: "ns-1", ActivityType: "Refund", Key: "order-1"},
	} {
		_, outcome, err := dedupactivity.Do(context.Background(), b.d, id, in, b.post)
		require.NoError(t, err)
		require.Equal(t, dedupactivity.OutcomeClaimed, outcome, "%+v is an event of its own", id)
	}
	_, outcome, err := dedupactivity.Do(context.Background(), b.d,
		dedupactivity.Identity{Kind: dedupactivity.KindBusinessKey, Namespace: "ns-2", ActivityType: "Post", Key: "order-1"}, in, b.post)
	require.NoError(t, err)
	require.Equal(t, dedupactivity.OutcomeDuplicate, outcome)
	require.Equal(t, int64(3), b.ledgerRows(t))
	require.Equal(t, int64(3), b.markers(t))
}

// TestFingerprintTopLevelZero: an input that is itself null, [] or {} (a
// nil or empty slice or map, which a workflow sends as null or as [] or
// {}) fingerprints as its members do, all equal; a non-zero one does not.
func TestFingerprintTopLevelZero(t *testing.T) {
	t.Parallel()
	fp := func(in any) []byte {
		f, err := dedupactivity.Fingerprint(in)
		require.NoError(t, err)
		return f
	}
	require.Equal(t, fp([]string(nil)), fp([]string{}))
	require.Equal(t, fp(map[string]int(nil)), fp(map[string]int{}))
	require.Equal(t, fp((*Transfer)(nil)), fp(&Transfer{}), "a nil pointer, as a member is")
	require.Equal(t, fp((*commonpb.Payload)(nil)), fp(&commonpb.Payload{}), "a proto message's too (protojson)")
	require.NotEqual(t, fp([]string{}), fp([]string{""}))
	require.NotEqual(t, fp(map[string]int{}), fp(map[string]int{"a": 1}))
}
