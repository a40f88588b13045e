import sys

from pagesim.cli import main

sys.exit(main())
