import sys

from modelyard.sidecar.cli import main

sys.exit(main())
