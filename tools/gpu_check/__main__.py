import sys

from tools.gpu_check.kit import main

sys.exit(main())
