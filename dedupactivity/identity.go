package dedupactivity

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"

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
	// Kind is what the event is, and so which of the fields below name it.
	Kind Kind
	// Namespace is the Temporal namespace the event belongs to (idemhttp
	// puts its own there); every Kind encodes it.
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
			return fmt.Errorf("%w: %s identity needs a workflow ID, run ID and activity ID", ErrInvalidIdentity, id.Kind)
		}
	case KindStandalone:
		if id.ActivityID == "" || id.ActivityRunID == "" {
			return fmt.Errorf("%w: standalone identity needs an activity ID and activity run ID", ErrInvalidIdentity)
		}
	case KindBusinessKey:
		if id.Key == "" {
			return fmt.Errorf("%w (activity type %q)", ErrEmptyBusinessKey, id.ActivityType)
		}
	default:
		return fmt.Errorf("%w: unknown identity kind %d", ErrInvalidIdentity, id.Kind)
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

// fingerprintVersion is the first byte of every fingerprint: a change of
// the rule once released gets a new version (none is released yet; the
// rule of 2026-12-04, zero inputs as null, is still version 1).
const fingerprintVersion = 1

// fingerprint returns the fingerprint of a business-keyed input: a version
// byte and the SHA-256 of the input's encoding by the default data converter
// (not the Deduper's, so an encrypting codec with random nonces cannot cause
// false mismatches). A JSON encoding is first put in a canonical form that
// drops object members whose value is null, false, 0, "", [] or {} and sorts
// the rest (and reads a zero input itself as null), so inputs that differ
// only by fields left at their zero value, or by member order, fingerprint
// equal (see WithBusinessKey).
func fingerprint(in any) ([]byte, error) {
	p, err := converter.GetDefaultDataConverter().ToPayload(in)
	if err != nil {
		return nil, fmt.Errorf("%w: fingerprint input: %w", ErrEncoding, err)
	}
	encoding := p.GetMetadata()[converter.MetadataEncoding]
	data := p.GetData()
	if string(encoding) == converter.MetadataEncodingNil {
		// A nil pointer, as JSON encodes it: equal to its zero value's
		// JSON, as a member is.
		encoding, data = []byte(converter.MetadataEncodingJSON), []byte("null")
	}
	if e := string(encoding); e == converter.MetadataEncodingJSON || e == converter.MetadataEncodingProtoJSON {
		if canon, err := canonicalJSON(data); err == nil {
			data = canon
		}
		if string(data) == "null" {
			// A zero input is one whichever JSON encoded it (an empty
			// proto message's is protojson's, a nil pointer's plain).
			encoding = []byte(converter.MetadataEncodingJSON)
		}
	}
	h := sha256.New()
	var lenBuf [binary.MaxVarintLen64]byte
	h.Write(lenBuf[:binary.PutUvarint(lenBuf[:], uint64(len(encoding)))])
	h.Write(encoding)
	h.Write(data)
	return h.Sum([]byte{fingerprintVersion}), nil
}

// canonicalJSON re-encodes a JSON document with object members sorted and
// members whose value is a zero value dropped (at every depth; array
// elements are kept, since their position matters), and a document that is
// a zero value itself as null, as a member would be (a nil slice and an
// empty one, which a workflow sends as null and [], are one input). Numbers
// keep their text.
func canonicalJSON(data []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if v = dropZero(v); isZeroJSON(v) {
		v = nil
	}
	return json.Marshal(v)
}

func dropZero(v any) any {
	switch v := v.(type) {
	case map[string]any:
		for k, m := range v {
			m = dropZero(m)
			if isZeroJSON(m) {
				delete(v, k)
			} else {
				v[k] = m
			}
		}
		return v
	case []any:
		for i, e := range v {
			v[i] = dropZero(e)
		}
		return v
	}
	return v
}

func isZeroJSON(v any) bool {
	switch v := v.(type) {
	case nil:
		return true
	case bool:
		return !v
	case string:
		return v == ""
	case json.Number:
		f, err := v.Float64()
		return err == nil && f == 0
	case map[string]any:
		return len(v) == 0
	case []any:
		return len(v) == 0
	}
	return false
}
