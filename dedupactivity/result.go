package dedupactivity

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"unicode/utf8"

	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/converter"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// converter is the Deduper's DataConverter with the activity's
// serialization context (outside an activity, what the identity holds: see
// identityInfo) and then, for a context-aware one (converter.ContextAware),
// ctx, as the SDK applies both to activity results.
func (d *Deduper) converter(ctx context.Context, info activity.Info) converter.DataConverter {
	sc := converter.ActivitySerializationContext{
		Namespace:    info.Namespace,
		WorkflowID:   info.WorkflowExecution.ID,
		ActivityType: info.ActivityType.Name,
		TaskQueue:    info.TaskQueue,
		IsLocal:      info.IsLocalActivity,
	}
	if info.WorkflowType != nil {
		sc.WorkflowType = info.WorkflowType.Name
	}
	dc := converter.WithDataConverterSerializationContext(d.opts.DataConverter, sc)
	if ca, ok := dc.(converter.ContextAware); ok {
		dc = ca.WithContext(ctx) // a key chosen by the workflow's starter, carried by a context propagator
	}
	return dc
}

// resultConverter is the data converter, with its serialization context,
// for the stored result of id delivered as info. A business key's
// deliveries come from any workflow, so its result is encoded and decoded
// in the context of the identity alone (namespace and activity type), which
// every delivery and Result share; a run-scoped result in the activity's.
func (d *Deduper) resultConverter(ctx context.Context, info activity.Info, id Identity) converter.DataConverter {
	if id.Kind == KindBusinessKey {
		return d.converter(ctx, identityInfo(id))
	}
	return d.converter(ctx, info)
}

// encodeResult encodes an effect's result for the marker: a serialized
// Temporal Payload, or empty when results are discarded.
func (d *Deduper) encodeResult(dc converter.DataConverter, v any) ([]byte, error) {
	if d.opts.DiscardResults {
		return []byte{}, nil
	}
	p, err := dc.ToPayload(v)
	if err != nil {
		return nil, fmt.Errorf("%w: encode result: %w", ErrEncoding, err)
	}
	b, err := marshalPayload(p)
	if err != nil {
		return nil, fmt.Errorf("%w: marshal result payload: %w", ErrEncoding, err)
	}
	// Measured as Temporal measures an activity's result against its payload
	// size limit: the Payloads it completes with, this Payload in it.
	if n := protowire.SizeTag(1) + protowire.SizeBytes(len(b)); n > d.opts.MaxResultBytes {
		return nil, fmt.Errorf("%w: %d bytes encoded (as Temporal sends it), MaxResultBytes is %d", ErrResultTooLarge, n, d.opts.MaxResultBytes)
	}
	return b, nil
}

// marshalPayload serializes p as proto.Marshal does with Deterministic set
// (metadata in key order). writePayload writes what it can directly: the
// reflection behind proto.Marshal cost more than the rest of the result's
// encoding on every first delivery. The rest goes through proto.Marshal,
// which refuses a metadata key that is not UTF-8 (as Unmarshal would), so a
// result that could not be read back is never stored.
func marshalPayload(p *commonpb.Payload) ([]byte, error) {
	if b, ok := writePayload(p); ok {
		return b, nil
	}
	return proto.MarshalOptions{Deterministic: true}.Marshal(p)
}

// writePayload writes p's wire format, or returns false for a payload it
// does not write: nil, one with external payload details or unknown fields,
// or one with a metadata key that is not UTF-8. TestMarshalPayload fails if
// Payload gains a field.
func writePayload(p *commonpb.Payload) ([]byte, bool) {
	if p == nil || len(p.ExternalPayloads) > 0 || len(p.ProtoReflect().GetUnknown()) > 0 {
		return nil, false
	}
	keys := make([]string, 0, len(p.Metadata))
	size := len(p.Data) + 6 // its tag and length: at most 6 bytes
	for k, v := range p.Metadata {
		if !utf8.ValidString(k) {
			return nil, false
		}
		keys = append(keys, k)
		size += len(k) + len(v) + 18 // tags and lengths: at most 18 bytes
	}
	slices.Sort(keys)
	b := make([]byte, 0, size)
	for _, k := range keys {
		v := p.Metadata[k]
		entry := protowire.SizeTag(1) + protowire.SizeBytes(len(k)) + protowire.SizeTag(2) + protowire.SizeBytes(len(v))
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(entry))
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		b = protowire.AppendString(b, k)
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendBytes(b, v)
	}
	if len(p.Data) > 0 {
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendBytes(b, p.Data)
	}
	return b, true
}

// asStored returns v, an effect's result, as a duplicate gets it: decoded
// from b, the bytes stored for it, since a converter's round trip changes
// some values (an int64 in an any comes back a float64, an empty []byte
// nil); v itself when nothing is stored (results discarded). It fails
// (ErrEncoding) when the converter cannot decode b (a non-empty interface,
// a type whose decoding refuses its own encoding): every duplicate would
// fail on it, so the first delivery fails instead, before it stores b.
func asStored[T any](dc converter.DataConverter, b []byte, v T) (T, error) {
	if len(b) == 0 {
		return v, nil
	}
	var out T
	if err := decodeResult(dc, b, &out); err != nil {
		return v, fmt.Errorf("%w (the result could not be read back as a duplicate reads it)", err)
	}
	return out, nil
}

// decodeResult decodes a stored result into out (a pointer).
func decodeResult(dc converter.DataConverter, b []byte, out any) error {
	p, err := unmarshalPayload(b)
	if err != nil {
		return fmt.Errorf("%w: unmarshal stored result: %w", ErrEncoding, err)
	}
	if err := dc.FromPayload(p, out); err != nil {
		return fmt.Errorf("%w: decode stored result: %w", ErrEncoding, err)
	}
	return nil
}

// unmarshalPayload reads b as proto.Unmarshal does into a Payload.
// readPayload reads what writePayload writes; the rest goes through
// proto.Unmarshal, whose reflection cost as much as the rest of a stored
// result's decoding, on every first delivery and every duplicate.
func unmarshalPayload(b []byte) (*commonpb.Payload, error) {
	if p, ok := readPayload(b); ok {
		return p, nil
	}
	p := &commonpb.Payload{}
	if err := proto.Unmarshal(b, p); err != nil {
		return nil, err
	}
	return p, nil
}

// readPayload reads b as proto.Unmarshal would, or returns false for what
// it does not read: anything but metadata entries of a UTF-8 key and a
// value, each once, and data that is not empty, at most once. It copies
// what it keeps, as proto.Unmarshal does, since b may be the connection's
// read buffer. FuzzUnmarshalPayload compares the two.
func readPayload(b []byte) (*commonpb.Payload, bool) {
	p := &commonpb.Payload{}
	for len(b) > 0 {
		num, v, rest, ok := nextField(b)
		if !ok {
			return nil, false
		}
		b = rest
		switch num {
		case 1:
			k, val, ok := readEntry(v)
			if !ok {
				return nil, false
			}
			if _, seen := p.Metadata[k]; seen {
				return nil, false
			}
			if p.Metadata == nil {
				p.Metadata = make(map[string][]byte, 1)
			}
			p.Metadata[k] = val
		case 2:
			if len(v) == 0 || p.Data != nil {
				return nil, false
			}
			p.Data = bytes.Clone(v)
		default:
			return nil, false
		}
	}
	return p, true
}

// readEntry reads a metadata entry as writePayload writes it: its key
// (field 1) and then its value (field 2), nothing else.
func readEntry(b []byte) (string, []byte, bool) {
	var field [2][]byte
	for i := range field {
		num, v, rest, ok := nextField(b)
		if !ok || num != protowire.Number(i+1) {
			return "", nil, false
		}
		field[i], b = v, rest
	}
	if len(b) > 0 || !utf8.Valid(field[0]) {
		return "", nil, false
	}
	return string(field[0]), bytes.Clone(field[1]), true
}

// nextField reads the length-delimited field that b starts with: its
// number, its value, and the bytes after it; false for any other wire type
// or a malformed field.
func nextField(b []byte) (protowire.Number, []byte, []byte, bool) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 || typ != protowire.BytesType {
		return 0, nil, nil, false
	}
	v, m := protowire.ConsumeBytes(b[n:])
	if m < 0 {
		return 0, nil, nil, false
	}
	return num, v, b[n+m:], true
}
