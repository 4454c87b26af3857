package dedupactivity

import (
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
// nil). v itself when nothing was stored (results discarded) or the
// converter cannot decode b (a duplicate then fails on it).
func asStored[T any](dc converter.DataConverter, b []byte, v T) T {
	if len(b) > 0 {
		var out T
		if decodeResult(dc, b, &out) == nil {
			return out
		}
	}
	return v
}

// decodeResult decodes a stored result into out (a pointer).
func decodeResult(dc converter.DataConverter, b []byte, out any) error {
	var p commonpb.Payload
	if err := proto.Unmarshal(b, &p); err != nil {
		return fmt.Errorf("%w: unmarshal stored result: %w", ErrEncoding, err)
	}
	if err := dc.FromPayload(&p, out); err != nil {
		return fmt.Errorf("%w: decode stored result: %w", ErrEncoding, err)
	}
	return nil
}
