package dedupactivity_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/workflow"

	"github.com/dedupactivity/dedupactivity/dedupactivity"
)

// contextConverter is a context-aware DataConverter, as one that encrypts
// with a key per workflow would be: it marks every payload with the
// workflow ID of its serialization context and records the contexts it
// was given.
type contextConverter struct {
	converter.DataConverter
	workflowID string
	seen       *[]converter.SerializationContext
	mu         *sync.Mutex
}

func (c contextConverter) WithSerializationContext(sc converter.SerializationContext) converter.DataConverter {
	c.mu.Lock()
	*c.seen = append(*c.seen, sc)
	c.mu.Unlock()
	if ac, ok := sc.(converter.ActivitySerializationContext); ok {
		c.workflowID = ac.WorkflowID
	}
	return c
}

func (c contextConverter) ToPayload(v any) (*commonpb.Payload, error) {
	p, err := c.DataConverter.ToPayload(v)
	if err == nil {
		p.Metadata["workflow-id"] = []byte(c.workflowID)
	}
	return p, err
}

// FromPayload refuses a payload encoded with another workflow ID, as a
// converter that decrypts with a key per workflow would fail.
func (c contextConverter) FromPayload(p *commonpb.Payload, valuePtr any) error {
	if got := string(p.Metadata["workflow-id"]); got != c.workflowID {
		return fmt.Errorf("payload of workflow %q decoded in the context of %q", got, c.workflowID)
	}
	return c.DataConverter.FromPayload(p, valuePtr)
}

// TestDataConverterWithSerializationContext: a context-aware converter gets
// the activity's serialization context for the stored result, as the SDK
// gives it for the activity result, and a duplicate decodes it back.
func TestDataConverterWithSerializationContext(t *testing.T) {
	t.Parallel()
	var seen []converter.SerializationContext
	dc := contextConverter{DataConverter: converter.GetDefaultDataConverter(), seen: &seen, mu: &sync.Mutex{}}
	b := setup(t, dedupactivity.Options{DataConverter: dc})
	fn := dedupactivity.Wrap(b.d, b.post)
	first, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 3})
	require.NoError(t, err)
	second, err := deliver(t, "Post", fn, Transfer{Account: "a", Amount: 3})
	require.NoError(t, err)
	require.Equal(t, first, second)

	var raw []byte
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT result FROM dedup_marker`).Scan(&raw))
	require.Contains(t, string(raw), "default-test-workflow-id", "the stored payload was encoded with the activity's context")
	require.NotEmpty(t, seen)
	for _, sc := range seen {
		ac, ok := sc.(converter.ActivitySerializationContext)
		require.True(t, ok, "%T", sc)
		require.Equal(t, "Post", ac.ActivityType)
		require.Equal(t, "default-test-workflow-id", ac.WorkflowID)
		require.NotEmpty(t, ac.TaskQueue)
	}
}

// TestBusinessKeyResultAcrossWorkflows: a business key's deliveries come
// from several workflows; with a converter that keys on the workflow, the
// stored result is encoded in the identity's context, so a duplicate from
// another workflow decodes it.
func TestBusinessKeyResultAcrossWorkflows(t *testing.T) {
	t.Parallel()
	var seen []converter.SerializationContext
	dc := contextConverter{DataConverter: converter.GetDefaultDataConverter(), seen: &seen, mu: &sync.Mutex{}}
	b := setup(t, dedupactivity.Options{DataConverter: dc})
	fn := dedupactivity.Wrap(b.d, b.post, dedupactivity.WithBusinessKey(func(in Transfer) (string, error) { return "order-" + in.Account, nil }))
	run := func(workflowID string) (Posting, error) {
		var s testsuite.WorkflowTestSuite
		env := s.NewTestWorkflowEnvironment()
		env.RegisterActivityWithOptions(fn, activity.RegisterOptions{Name: "Keyed"})
		env.RegisterWorkflowWithOptions(func(ctx workflow.Context, in Transfer) (Posting, error) {
			ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{StartToCloseTimeout: time.Minute,
				RetryPolicy: &temporal.RetryPolicy{MaximumAttempts: 1}})
			var p Posting
			err := workflow.ExecuteActivity(ctx, "Keyed", in).Get(ctx, &p)
			return p, err
		}, workflow.RegisterOptions{Name: "KeyedWorkflow"})
		env.SetStartWorkflowOptions(client.StartWorkflowOptions{ID: workflowID})
		env.ExecuteWorkflow("KeyedWorkflow", Transfer{Account: "a", Amount: 3})
		var p Posting
		if err := env.GetWorkflowError(); err != nil {
			return p, err
		}
		return p, env.GetWorkflowResult(&p)
	}
	first, err := run("wf-A")
	require.NoError(t, err)
	second, err := run("wf-B")
	require.NoError(t, err, "the duplicate from another workflow decodes the stored result")
	require.Equal(t, first, second)
	require.Equal(t, int64(1), b.ledgerRows(t))
}

// TestDoReturnsTheSameValueFirstAndAgain: Do returns a first delivery's
// result as a duplicate would see it, decoded by the data converter, so the
// two are equal even for types the converter does not round-trip (an int64
// in an any becomes a float64).
func TestDoReturnsTheSameValueFirstAndAgain(t *testing.T) {
	t.Parallel()
	first, again := doTwice(t, func(ctx context.Context, tx pgx.Tx, in int) (map[string]any, error) {
		return map[string]any{"n": int64(in)}, nil
	})
	require.Equal(t, again, first)
	require.IsType(t, float64(0), first["n"])
}

// TestResultSerializationContext: outside an activity, Do encodes with the
// context id gives (here its workflow ID), and Result decodes with that
// same context wherever it is called, an activity of another workflow
// included.
func TestResultSerializationContext(t *testing.T) {
	t.Parallel()
	var seen []converter.SerializationContext
	dc := contextConverter{DataConverter: converter.GetDefaultDataConverter(), seen: &seen, mu: &sync.Mutex{}}
	b := setup(t, dedupactivity.Options{DataConverter: dc})
	id := dedupactivity.Identity{Kind: dedupactivity.KindActivity, Namespace: "n", WorkflowID: "w-1", RunID: "r-1", ActivityID: "1"}
	first, _, err := dedupactivity.Do(context.Background(), b.d, id, Transfer{Account: "a", Amount: 3}, b.post)
	require.NoError(t, err)
	var raw []byte
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT result FROM dedup_marker`).Scan(&raw))
	require.Contains(t, string(raw), "w-1", "encoded with the identity's workflow ID")

	read, err := deliver(t, "Read", func(ctx context.Context, _ int) (Posting, error) {
		var p Posting
		ok, err := b.d.Result(ctx, id, &p)
		if !ok && err == nil {
			err = fmt.Errorf("not applied")
		}
		return p, err
	}, 0) // in the test environment's workflow, not w-1
	require.NoError(t, err)
	require.Equal(t, first, read)
}

// keyIDKey is the context key of the encryption key ID that keyPropagator
// carries from a workflow's starter to its activities.
type keyIDKey struct{}

// keyPropagator carries the "key-id" header into the activity context, as
// the propagator of Temporal's encryption sample carries the key ID a
// workflow's starter chose.
type keyPropagator struct{}

func (keyPropagator) Inject(ctx context.Context, w workflow.HeaderWriter) error {
	return injectKeyID(ctx.Value(keyIDKey{}), w)
}

func (keyPropagator) InjectFromWorkflow(ctx workflow.Context, w workflow.HeaderWriter) error {
	return injectKeyID(ctx.Value(keyIDKey{}), w)
}

func injectKeyID(v any, w workflow.HeaderWriter) error {
	if id, ok := v.(string); ok {
		p, err := converter.GetDefaultDataConverter().ToPayload(id)
		if err != nil {
			return err
		}
		w.Set("key-id", p)
	}
	return nil
}

func (keyPropagator) Extract(ctx context.Context, r workflow.HeaderReader) (context.Context, error) {
	if p, ok := r.Get("key-id"); ok {
		var id string
		if err := converter.GetDefaultDataConverter().FromPayload(p, &id); err != nil {
			return ctx, err
		}
		ctx = context.WithValue(ctx, keyIDKey{}, id)
	}
	return ctx, nil
}

func (keyPropagator) ExtractToWorkflow(ctx workflow.Context, r workflow.HeaderReader) (workflow.Context, error) {
	if p, ok := r.Get("key-id"); ok {
		var id string
		if err := converter.GetDefaultDataConverter().FromPayload(p, &id); err != nil {
			return ctx, err
		}
		ctx = workflow.WithValue(ctx, keyIDKey{}, id)
	}
	return ctx, nil
}

// keyedConverter is a context-aware DataConverter (converter.ContextAware)
// as the one of Temporal's encryption sample is: the SDK gives it the
// activity's context, from which it takes the key ID to encrypt with. It
// marks every payload with that key ID ("" when it was given none, as the
// sample's does).
type keyedConverter struct {
	converter.DataConverter
	keyID string
}

func (c keyedConverter) WithContext(ctx context.Context) converter.DataConverter {
	if id, ok := ctx.Value(keyIDKey{}).(string); ok {
		c.keyID = id
	}
	return c
}

func (c keyedConverter) WithWorkflowContext(ctx workflow.Context) converter.DataConverter {
	if id, ok := ctx.Value(keyIDKey{}).(string); ok {
		c.keyID = id
	}
	return c
}

func (c keyedConverter) ToPayload(v any) (*commonpb.Payload, error) {
	p, err := c.DataConverter.ToPayload(v)
	if err == nil {
		p.Metadata["encryption-key-id"] = []byte(c.keyID)
	}
	return p, err
}

func (c keyedConverter) ToPayloads(vs ...any) (*commonpb.Payloads, error) {
	out := &commonpb.Payloads{}
	for _, v := range vs {
		p, err := c.ToPayload(v)
		if err != nil {
			return nil, err
		}
		out.Payloads = append(out.Payloads, p)
	}
	return out, nil
}

// TestContextAwareDataConverter: a context-aware converter (the key ID of
// Temporal's encryption sample, chosen by the workflow's starter and carried
// to the activity by a context propagator) is given the activity's context
// for the stored result, as the SDK gives it for the activity's result, so
// the result at rest is encoded as the SDK encodes it (here: with the
// workflow's key, not with none), and a duplicate decodes it.
func TestContextAwareDataConverter(t *testing.T) {
	t.Parallel()
	dc := keyedConverter{DataConverter: converter.GetDefaultDataConverter()}
	b := setup(t, dedupactivity.Options{DataConverter: dc})
	fn := dedupactivity.Wrap(b.d, b.post)
	header, err := converter.GetDefaultDataConverter().ToPayload("tenant-7")
	require.NoError(t, err)
	run := func() (Posting, error) {
		var s testsuite.WorkflowTestSuite
		env := s.NewTestActivityEnvironment()
		env.SetDataConverter(dc)
		env.SetContextPropagators([]workflow.ContextPropagator{keyPropagator{}})
		env.SetHeader(&commonpb.Header{Fields: map[string]*commonpb.Payload{"key-id": header}})
		env.RegisterActivityWithOptions(fn, activity.RegisterOptions{Name: "Post"})
		var p Posting
		val, err := env.ExecuteActivity("Post", Transfer{Account: "a", Amount: 3})
		if err != nil {
			return p, err
		}
		return p, val.Get(&p)
	}
	first, err := run()
	require.NoError(t, err)
	second, err := run()
	require.NoError(t, err)
	require.Equal(t, first, second)
	require.Equal(t, int64(1), b.ledgerRows(t))

	var raw []byte
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT result FROM dedup_marker`).Scan(&raw))
	require.Contains(t, string(raw), "tenant-7", "the stored payload was encoded with the key ID of the activity's context")
}
