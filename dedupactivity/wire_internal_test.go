package dedupactivity

import (
	"reflect"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestOpenClaimsOfALargeTransactionAreDropped: the open claims a connection
// keeps are the current transaction's only, and the map of a transaction
// that claimed more than 64 events is dropped, not cleared, when the next
// transaction claims (clear keeps a map's buckets: a review measured about
// 10 MB held by a pooled connection after one transaction of 200k claims).
// A small transaction's map is cleared and reused.
func TestOpenClaimsOfALargeTransactionAreDropped(t *testing.T) {
	sumOf := func(i int) (s [32]byte) {
		copy(s[:], strconv.Itoa(i))
		return s
	}
	mapOf := func(s *connState) uintptr { return uintptr(reflect.ValueOf(s.open).UnsafePointer()) }
	claimMany := func(s *connState, xact string, n int) {
		for i := range n {
			s.claimOpen(sumOf(i), xact, xact)
		}
	}

	var s connState
	claimMany(&s, "100", 65)
	require.Len(t, s.open, 65)
	require.Equal(t, "100", s.openIn(sumOf(64), "100"))
	large := mapOf(&s)
	s.claimOpen(sumOf(0), "101", "101")
	require.Len(t, s.open, 1, "the previous transaction's claims are forgotten")
	require.NotEqual(t, large, mapOf(&s), "a map that held 65 claims is dropped")
	require.Empty(t, s.openIn(sumOf(1), "100"))
	require.Equal(t, "101", s.openIn(sumOf(0), "101"))
	require.Empty(t, s.openIn(sumOf(0), "100"), "the same event's row from another transaction is not this claim")

	claimMany(&s, "102", 64)
	small := mapOf(&s)
	s.claimOpen(sumOf(0), "103", "103")
	require.Len(t, s.open, 1)
	require.Equal(t, small, mapOf(&s), "a map that held 64 claims is cleared and kept")

	s.completed(sumOf(0))
	require.Empty(t, s.openIn(sumOf(0), "103"), "a completed claim is no longer open")
}
