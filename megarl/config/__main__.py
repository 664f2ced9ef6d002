import sys

from megarl.config.cli import main

sys.exit(main())
