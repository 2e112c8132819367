import sys

from verifypd_loadgen.cli import main

sys.exit(main())
