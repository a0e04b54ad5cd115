import sys

from pycompactor.cli.commands import main

sys.exit(main())
