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

// TestMarshalPayload: marshalPayload writes the bytes proto.Marshal writes
// with Deterministic set, for payloads the default converters make and for
// edge cases (empty values, lengths of two- and three-byte varints); a
// payload with fields it does not write goes through proto.Marshal, and
// every result unmarshals to an equal payload.
func TestMarshalPayload(t *testing.T) {
	long := bytes.Repeat([]byte("x"), 20_000)
	fromConverter, err := converter.GetDefaultDataConverter().ToPayload(map[string]int{"entry": 7})
	require.NoError(t, err)
	withUnknown := &commonpb.Payload{Data: []byte("d")}
	withUnknown.ProtoReflect().SetUnknown(protowire.AppendBytes(protowire.AppendTag(nil, 99, protowire.BytesType), []byte("u")))
	for name, p := range map[string]*commonpb.Payload{
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
	} {
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
