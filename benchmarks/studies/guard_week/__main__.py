import sys

from benchmarks.studies.guard_week.run import main

sys.exit(main())
