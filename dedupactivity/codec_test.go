package dedupactivity_test

import (
	"context"
	"time"

	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/workflow"
)

const xorEncoding = "binary/xor-test"

// xorCodec stands in for an encrypting codec: it changes every byte and
// marks the payload, so tests can see it was applied to stored results.
type xorCodec struct{}

func (xorCodec) Encode(ps []*commonpb.Payload) ([]*commonpb.Payload, error) {
	out := make([]*commonpb.Payload, len(ps))
	for i, p := range ps {
		b, err := p.Marshal()
		if err != nil {
			return nil, err
		}
		out[i] = &commonpb.Payload{Metadata: map[string][]byte{converter.MetadataEncoding: []byte(xorEncoding)}, Data: xor(b)}
	}
	return out, nil
}

func (xorCodec) Decode(ps []*commonpb.Payload) ([]*commonpb.Payload, error) {
	out := make([]*commonpb.Payload, len(ps))
	for i, p := range ps {
		if string(p.Metadata[converter.MetadataEncoding]) != xorEncoding {
			out[i] = p
			continue
		}
		var inner commonpb.Payload
		if err := inner.Unmarshal(xor(p.Data)); err != nil {
			return nil, err
		}
		out[i] = &inner
	}
	return out, nil
}

func xor(b []byte) []byte {
	out := make([]byte, len(b))
	for i := range b {
		out[i] = b[i] ^ 0x5a
	}
	return out
}

func newXORConverter() converter.DataConverter {
	return converter.NewCodecDataConverter(converter.GetDefaultDataConverter(), xorCodec{})
}

// postWorkflow runs the "Post" activity once.
func postWorkflow(ctx workflow.Context, in Transfer) (Posting, error) {
	ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{StartToCloseTimeout: time.Minute})
	var p Posting
	err := workflow.ExecuteActivity(ctx, "Post", in).Get(ctx, &p)
	return p, err
}

func clientStartOptions(workflowID string) client.StartWorkflowOptions {
	return client.StartWorkflowOptions{ID: workflowID}
}

var _ = context.Background
