package dedupactivity

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/converter"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// testPayloads are payloads the default converters make and edge cases:
// empty values, lengths of two- and three-byte varints, fields
// writePayload does not write.
func testPayloads(t testing.TB) map[string]*commonpb.Payload {
	long := bytes.Repeat([]byte("x"), 20_000)
	fromConverter, err := converter.GetDefaultDataConverter().ToPayload(map[string]int{"entry": 7})
	require.NoError(t, err)
	withUnknown := &commonpb.Payload{Data: []byte("d")}
	withUnknown.ProtoReflect().SetUnknown(protowire.AppendBytes(protowire.AppendTag(nil, 99, protowire.BytesType), []byte("u")))
	return map[string]*commonpb.Payload{
		"converter":      fromConverter,
		"empty":          {},
		"no data":        {Metadata: map[string][]byte{"encoding": []byte("binary/null")}},
		"empty value":    {Metadata: map[string][]byte{"encoding": {}}, Data: []byte("1")},
		"empty key":      {Metadata: map[string][]byte{"": []byte("v")}, Data: []byte("1")},
		"several keys":   {Metadata: map[string][]byte{"z": []byte("1"), "a": []byte("2"), "m": []byte("3"), "encoding": []byte("json/plain")}, Data: []byte(`{"a":1}`)},
		"long data":      {Metadata: map[string][]byte{"encoding": []byte("binary/plain")}, Data: long[:200]},
		"longer data":    {Metadata: map[string][]byte{"encoding": []byte("binary/plain")}, Data: long},
		"long key":       {Metadata: map[string][]byte{strings.Repeat("k", 300): long[:300]}},
		"external":       {Data: []byte("d"), ExternalPayloads: []*commonpb.Payload_ExternalPayloadDetails{{SizeBytes: 12}}},
		"unknown fields": withUnknown,
		"nil":            nil,
	}
}

// TestMarshalPayload: marshalPayload writes the bytes proto.Marshal writes
// with Deterministic set, for payloads the default converters make and for
// edge cases (empty values, lengths of two- and three-byte varints); a
// payload with fields it does not write goes through proto.Marshal, and
// every result unmarshals to an equal payload.
func TestMarshalPayload(t *testing.T) {
	for name, p := range testPayloads(t) {
		t.Run(name, func(t *testing.T) {
			got, err := marshalPayload(p)
			require.NoError(t, err)
			want, err := proto.MarshalOptions{Deterministic: true}.Marshal(p)
			require.NoError(t, err)
			require.Equal(t, want, got)
			_, written := writePayload(p)
			require.Equal(t, name != "external" && name != "unknown fields" && name != "nil", written, "written by hand, not by proto.Marshal")
			var back commonpb.Payload
			require.NoError(t, proto.Unmarshal(got, &back))
			if p != nil {
				require.True(t, proto.Equal(p, &back), "round trip: %v", &back)
			}
		})
	}
}

// TestMarshalPayloadRefusesWhatProtoRefuses: a metadata key that is not
// UTF-8 fails to encode (so no marker stores a result that cannot be
// decoded), and Payload still has the three fields marshalPayload writes.
func TestMarshalPayloadRefusesWhatProtoRefuses(t *testing.T) {
	notUTF8 := &commonpb.Payload{Metadata: map[string][]byte{"\xff": []byte("v")}, Data: []byte("1")}
	_, written := writePayload(notUTF8)
	require.False(t, written)
	_, err := marshalPayload(notUTF8)
	require.Error(t, err)
	fields := (&commonpb.Payload{}).ProtoReflect().Descriptor().Fields()
	require.Equal(t, 3, fields.Len(), "Payload changed: marshalPayload writes metadata (1), data (2) and falls back on external_payloads (3)")
	for i, name := range []string{"metadata", "data", "external_payloads"} {
		require.Equal(t, name, string(fields.Get(i).Name()))
		require.EqualValues(t, i+1, fields.Get(i).Number())
	}
}

// oddPayloads are encodings writePayload does not write, but that
// proto.Unmarshal reads (or refuses): a stored result's bytes are read by
// unmarshalPayload whatever wrote them.
func oddPayloads() map[string][]byte {
	tag := func(b []byte, n protowire.Number) []byte { return protowire.AppendTag(b, n, protowire.BytesType) }
	field := func(b []byte, n protowire.Number, v []byte) []byte { return protowire.AppendBytes(tag(b, n), v) }
	entry := func(k, v string) []byte { return field(field(nil, 1, []byte(k)), 2, []byte(v)) }
	return map[string][]byte{
		"value before key":  field(nil, 1, field(field(nil, 2, []byte("v")), 1, []byte("k"))),
		"key only":          field(nil, 1, field(nil, 1, []byte("k"))),
		"value only":        field(nil, 1, field(nil, 2, []byte("v"))),
		"empty entry":       field(nil, 1, nil),
		"entry with more":   field(nil, 1, field(entry("k", "v"), 3, []byte("x"))),
		"key twice":         field(field(nil, 1, entry("k", "1")), 1, entry("k", "2")),
		"data twice":        field(field(nil, 2, []byte("a")), 2, []byte("b")),
		"empty data":        field(field(nil, 1, entry("encoding", "binary/plain")), 2, nil),
		"data first":        field(field(nil, 2, []byte("d")), 1, entry("encoding", "json/plain")),
		"key not UTF-8":     field(nil, 1, entry("\xff", "v")),
		"value not UTF-8":   field(nil, 1, entry("k", "\xff")),
		"external payloads": field(field(nil, 2, []byte("d")), 3, protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 12)),
		"unknown field":     field(field(nil, 2, []byte("d")), 99, []byte("u")),
		"data as varint":    protowire.AppendVarint(protowire.AppendTag(nil, 2, protowire.VarintType), 1),
		"truncated length":  append(tag(nil, 2), 0x80),
		"truncated data":    append(tag(nil, 2), 5, 'a'),
		"truncated entry":   field(nil, 1, append(tag(nil, 1), 3, 'k')),
		"field number zero": field(nil, 0, []byte("x")),
		"garbage":           {0xff, 0xff, 0xff},
		"empty":             {},
	}
}

// samePayload says whether a and b are equal as proto.Equal says, and also
// in what it leaves out: which of their bytes and maps are nil rather than
// empty (a converter's []byte result is the payload's data itself).
func samePayload(a, b *commonpb.Payload) bool {
	if !proto.Equal(a, b) || (a.Data == nil) != (b.Data == nil) || (a.Metadata == nil) != (b.Metadata == nil) {
		return false
	}
	for k, v := range a.Metadata {
		if (v == nil) != (b.Metadata[k] == nil) {
			return false
		}
	}
	return true
}

// checkUnmarshal fails unless unmarshalPayload reads b as proto.Unmarshal
// does: the same payload, or an error from both. It returns whether
// readPayload read it (not proto.Unmarshal).
func checkUnmarshal(t *testing.T, b []byte) bool {
	t.Helper()
	want := &commonpb.Payload{}
	wantErr := proto.Unmarshal(b, want)
	got, err := unmarshalPayload(b)
	if (err != nil) != (wantErr != nil) {
		t.Fatalf("unmarshalPayload(%x): error %v, proto.Unmarshal: %v", b, err, wantErr)
	}
	if err == nil && !samePayload(got, want) {
		t.Fatalf("unmarshalPayload(%x) = %#v, proto.Unmarshal: %#v", b, got, want)
	}
	_, read := readPayload(b)
	return read
}

// TestUnmarshalPayload: unmarshalPayload reads what marshalPayload writes,
// and odd encodings, as proto.Unmarshal does; what writePayload writes it
// reads by hand, so a first delivery and a duplicate decode without
// reflection; and what it reads it copies, so a value read from a
// connection's buffer survives the buffer's next use.
func TestUnmarshalPayload(t *testing.T) {
	for name, p := range testPayloads(t) {
		t.Run(name, func(t *testing.T) {
			b, err := marshalPayload(p)
			require.NoError(t, err)
			_, written := writePayload(p)
			// A nil payload is written as no bytes, by proto.Marshal.
			require.Equal(t, written || len(b) == 0, checkUnmarshal(t, b), "read by hand exactly when written by hand")
		})
	}
	for name, b := range oddPayloads() {
		t.Run(name, func(t *testing.T) {
			checkUnmarshal(t, b)
		})
	}
	t.Run("copies", func(t *testing.T) {
		b, err := marshalPayload(&commonpb.Payload{Metadata: map[string][]byte{"encoding": []byte("binary/plain")}, Data: []byte("data")})
		require.NoError(t, err)
		p, err := unmarshalPayload(b)
		require.NoError(t, err)
		clear(b)
		require.Equal(t, "data", string(p.Data))
		require.Equal(t, "binary/plain", string(p.Metadata["encoding"]))
	})
}

// FuzzUnmarshalPayload: unmarshalPayload reads any bytes as proto.Unmarshal
// does.
func FuzzUnmarshalPayload(f *testing.F) {
	for _, p := range testPayloads(f) {
		b, err := marshalPayload(p)
		require.NoError(f, err)
		f.Add(b)
	}
	for _, b := range oddPayloads() {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		checkUnmarshal(t, b)
	})
}

// BenchmarkMarshalPayload compares marshalPayload with proto.Marshal on the
// payload the default converter makes for a small result.
func BenchmarkMarshalPayload(b *testing.B) {
	p, err := converter.GetDefaultDataConverter().ToPayload(map[string]int64{"EntryID": 123456, "Balance": 42})
	require.NoError(b, err)
	b.Run("marshalPayload", func(b *testing.B) {
		for b.Loop() {
			_, _ = marshalPayload(p)
		}
	})
	b.Run("proto.Marshal", func(b *testing.B) {
		for b.Loop() {
			_, _ = proto.Marshal(p)
		}
	})
}
