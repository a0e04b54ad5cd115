import sys

from pycompactor.cli import main

sys.exit(main())
