import sys

from pycompactor.cli.main import main

sys.exit(main())
