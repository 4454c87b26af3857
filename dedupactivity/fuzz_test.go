package dedupactivity_test

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

func identityOf(kind uint8, a, b, c, d string) dedupactivity.Identity {
	k := dedupactivity.Kind(kind%4 + 1)
	id := dedupactivity.Identity{Kind: k, Namespace: a}
	switch k {
	case dedupactivity.KindActivity, dedupactivity.KindLocalActivity:
		id.WorkflowID, id.RunID, id.ActivityID = b, c, d
	case dedupactivity.KindStandalone:
		id.ActivityID, id.ActivityRunID = b, c
	case dedupactivity.KindBusinessKey:
		id.ActivityType, id.Key = b, c
	}
	return id
}

// FuzzIdentityEncode checks that distinct identities never encode equal and
// equal identities always do.
func FuzzIdentityEncode(f *testing.F) {
	f.Add(uint8(0), "ns", "wf", "run", "1", uint8(1), "ns", "wf", "run", "1")
	f.Add(uint8(0), "ns", "ab", "c", "1", uint8(0), "ns", "a", "bc", "1")
	f.Add(uint8(3), "ns", "T", "k\x00", "", uint8(3), "ns", "T", "k", "\x00")
	f.Add(uint8(2), "", "\xff\xfe", "x", "", uint8(2), "\xff", "\xfex", "", "")
	f.Fuzz(func(t *testing.T, k1 uint8, a1, b1, c1, d1 string, k2 uint8, a2, b2, c2, d2 string) {
		x, y := identityOf(k1, a1, b1, c1, d1), identityOf(k2, a2, b2, c2, d2)
		same := x == y
		if got := bytes.Equal(x.Encode(), y.Encode()); got != same {
			t.Fatalf("identities equal=%v but encodings equal=%v:\n%#v\n%#v", same, got, x, y)
		}
		if !bytes.Equal(x.Encode(), identityOf(k1, a1, b1, c1, d1).Encode()) {
			t.Fatal("encoding is not deterministic")
		}
	})
}

// FuzzFingerprint checks that equal inputs always fingerprint equal and
// different inputs never do.
func FuzzFingerprint(f *testing.F) {
	f.Add("a", int64(1), "a", int64(1))
	f.Add("a", int64(1), "a", int64(2))
	f.Add("a\x00", int64(0), "a", int64(0))
	f.Add("\xff", int64(-1), "\xfe", int64(-1))
	f.Fuzz(func(t *testing.T, a1 string, n1 int64, a2 string, n2 int64) {
		x, y := Transfer{Account: a1, Amount: n1}, Transfer{Account: a2, Amount: n2}
		fx, err := dedupactivity.Fingerprint(x)
		if err != nil {
			t.Fatal(err)
		}
		fy, err := dedupactivity.Fingerprint(y)
		if err != nil {
			t.Fatal(err)
		}
		// The fingerprint covers the input's JSON payload, in which Go
		// replaces each invalid UTF-8 byte with U+FFFD: inputs that differ
		// only there fingerprint equal (a documented limit). Any other
		// difference must show.
		jx, err := json.Marshal(x)
		if err != nil {
			t.Fatal(err)
		}
		jy, err := json.Marshal(y)
		if err != nil {
			t.Fatal(err)
		}
		same := bytes.Equal(jx, jy)
		if x == y && !same {
			t.Fatal("equal inputs encode differently")
		}
		if bytes.Equal(fx, fy) != same {
			t.Fatalf("inputs %+v and %+v: equal=%v, fingerprints equal=%v", x, y, same, bytes.Equal(fx, fy))
		}
	})
}
