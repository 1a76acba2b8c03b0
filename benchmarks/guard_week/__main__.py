import sys

from benchmarks.guard_week.run import main

sys.exit(main())
