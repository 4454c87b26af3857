// Package tallytest checks dedupactivity's metrics through the Temporal SDK's
// metrics handler (Options.TemporalMetrics) when that handler is Tally with
// its Prometheus reporter, as go.temporal.io/sdk/contrib/tally wires it. It
// has tests only; it keeps Tally out of the library module.
package tallytest
