import sys

from slime_search.train import main

if __name__ == "__main__":
    sys.exit(main())
