package dedupactivity

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"sort"

	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/converter"
)

// Kind says what an Identity is scoped to.
type Kind uint8

const (
	// KindActivity is a regular activity scheduled by a workflow run:
	// namespace, workflow ID, run ID and activity ID.
	KindActivity Kind = 1
	// KindLocalActivity is a local activity of a workflow run. Local
	// activities count their IDs from a separate counter, so a local and a
	// regular activity can share an activity ID in one run; the kind keeps
	// them apart.
	KindLocalActivity Kind = 2
	// KindStandalone is an activity started without a workflow: namespace,
	// activity ID and activity run ID.
	KindStandalone Kind = 3
	// KindBusinessKey is a key supplied by the user (see WithBusinessKey),
	// scoped to the namespace and the activity type.
	KindBusinessKey Kind = 4
)

// String returns the kind as recorded in the dedup.identity.kind attribute.
func (k Kind) String() string {
	switch k {
	case KindActivity:
		return "activity"
	case KindLocalActivity:
		return "local_activity"
	case KindStandalone:
		return "standalone"
	case KindBusinessKey:
		return "business_key"
	default:
		return fmt.Sprintf("Kind(%d)", uint8(k))
	}
}

// Identity is the stable identity of one event: every delivery (retry
// attempt, overlapping attempt, redelivery after a lost completion) of the
// same event has the same Identity.
//
// Only the fields that belong to the Kind are encoded; the others are
// ignored.
type Identity struct {
	Kind          Kind
	Namespace     string
	WorkflowID    string // KindActivity, KindLocalActivity
	RunID         string // KindActivity, KindLocalActivity
	ActivityID    string // KindActivity, KindLocalActivity, KindStandalone
	ActivityRunID string // KindStandalone
	ActivityType  string // KindBusinessKey
	Key           string // KindBusinessKey
}

// IdentityFromInfo derives the default, run-scoped identity of an activity
// attempt. The attempt number is not part of it: all attempts of one
// scheduled activity share an identity. The run ID is: continue-as-new,
// workflow retry, cron and reset start a new run whose activities are new
// events, even when they reuse the same activity IDs.
func IdentityFromInfo(info activity.Info) Identity {
	switch {
	case info.WorkflowExecution.ID == "" && info.ActivityRunID != "":
		return Identity{Kind: KindStandalone, Namespace: info.Namespace, ActivityID: info.ActivityID, ActivityRunID: info.ActivityRunID}
	case info.IsLocalActivity:
		return Identity{Kind: KindLocalActivity, Namespace: info.Namespace, WorkflowID: info.WorkflowExecution.ID, RunID: info.WorkflowExecution.RunID, ActivityID: info.ActivityID}
	default:
		return Identity{Kind: KindActivity, Namespace: info.Namespace, WorkflowID: info.WorkflowExecution.ID, RunID: info.WorkflowExecution.RunID, ActivityID: info.ActivityID}
	}
}

// identityVersion is the first byte of every encoding; a change of layout
// gets a new version, so old and new encodings never collide.
const identityVersion = 1

// Encode returns the canonical encoding of id: a version byte, the kind, and
// each field of the kind as a uvarint length followed by its bytes. Fields
// are stored as raw bytes: NUL bytes and invalid UTF-8 are kept as they are.
// Distinct identities never encode equal (the encoding is prefix-free).
func (id Identity) Encode() []byte {
	fields := id.fields()
	n := 2
	for _, f := range fields {
		n += binary.MaxVarintLen64 + len(f)
	}
	b := make([]byte, 0, n)
	b = append(b, identityVersion, byte(id.Kind))
	for _, f := range fields {
		b = binary.AppendUvarint(b, uint64(len(f)))
		b = append(b, f...)
	}
	return b
}

func (id Identity) fields() []string {
	switch id.Kind {
	case KindActivity, KindLocalActivity:
		return []string{id.Namespace, id.WorkflowID, id.RunID, id.ActivityID}
	case KindStandalone:
		return []string{id.Namespace, id.ActivityID, id.ActivityRunID}
	case KindBusinessKey:
		return []string{id.Namespace, id.ActivityType, id.Key}
	default:
		return nil
	}
}

// validate reports an identity that cannot be stored.
func (id Identity) validate(enc []byte) error {
	switch id.Kind {
	case KindActivity, KindLocalActivity:
		if id.WorkflowID == "" || id.RunID == "" || id.ActivityID == "" {
			return fmt.Errorf("%w: %s identity needs a workflow ID, run ID and activity ID", ErrNotActivity, id.Kind)
		}
	case KindStandalone:
		if id.ActivityID == "" || id.ActivityRunID == "" {
			return fmt.Errorf("%w: standalone identity needs an activity ID and activity run ID", ErrNotActivity)
		}
	case KindBusinessKey:
		if id.Key == "" {
			return fmt.Errorf("%w (activity type %q)", ErrEmptyBusinessKey, id.ActivityType)
		}
	default:
		return fmt.Errorf("%w: unknown identity kind %d", ErrInvalidOptions, id.Kind)
	}
	if len(enc) > MaxIdentityBytes {
		return fmt.Errorf("%w: %d bytes encoded, limit %d", ErrIdentityTooLarge, len(enc), MaxIdentityBytes)
	}
	return nil
}

// Hash returns the SHA-256 of the identity's encoding: the marker table's
// primary key.
func (id Identity) Hash() [32]byte { return sha256Sum(id.Encode()) }

func sha256Sum(b []byte) [32]byte { return sha256.Sum256(b) }

// fingerprintAlgSHA256JSON identifies the input fingerprint algorithm: SHA-256
// over the default data converter's payload (metadata sorted by key, then
// data), independent of the Deduper's own DataConverter so an encrypting
// codec with random nonces cannot cause false mismatches. A future algorithm
// gets a new number; markers made by another algorithm are not compared.
const fingerprintAlgSHA256JSON int16 = 1

// fingerprint returns the fingerprint of an activity input.
func fingerprint(in any) ([]byte, error) {
	p, err := converter.GetDefaultDataConverter().ToPayload(in)
	if err != nil {
		return nil, fmt.Errorf("%w: fingerprint input: %w", ErrEncoding, err)
	}
	h := sha256.New()
	keys := make([]string, 0, len(p.GetMetadata()))
	for k := range p.GetMetadata() {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var lenBuf [binary.MaxVarintLen64]byte
	write := func(b []byte) {
		h.Write(lenBuf[:binary.PutUvarint(lenBuf[:], uint64(len(b)))])
		h.Write(b)
	}
	for _, k := range keys {
		write([]byte(k))
		write(p.GetMetadata()[k])
	}
	write(p.GetData())
	return h.Sum(nil), nil
}
