package dedupactivity_test

import (
	"testing"

	"github.com/dedupactivity/dedupactivity/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }
