package dedupactivity

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestFingerprintOnlyBusinessKeys checks that a run-scoped input is neither
// fingerprinted nor boxed into an interface (no allocation), and that a
// business-keyed one is fingerprinted.
func TestFingerprintOnlyBusinessKeys(t *testing.T) {
	type transfer struct {
		Account string
		Amount  int64
	}
	in := transfer{Account: "a", Amount: 1}
	m := &marker{}
	runScoped := Identity{Kind: KindActivity, Namespace: "ns", WorkflowID: "w", RunID: "r", ActivityID: "1"}
	allocs := testing.AllocsPerRun(100, func() {
		if err := fingerprintInput(m, runScoped, in); err != nil {
			t.Fatal(err)
		}
	})
	require.Zero(t, allocs)
	require.Nil(t, m.fingerprint)

	require.NoError(t, fingerprintInput(m, Identity{Kind: KindBusinessKey, Namespace: "ns", ActivityType: "T", Key: "k"}, in))
	require.NotEmpty(t, m.fingerprint)
}

// TestAppendLockTimeout: a duration as the lock_timeout setting the claim and
// partition maintenance send, in whole milliseconds.
func TestAppendLockTimeout(t *testing.T) {
	require.Equal(t, "250ms", string(appendLockTimeout(nil, 250*time.Millisecond)))
	require.Equal(t, "1ms", string(appendLockTimeout(nil, 1500*time.Microsecond)))
	require.Equal(t, "x86400000ms", string(appendLockTimeout([]byte("x"), maxClaimWait)))
}
