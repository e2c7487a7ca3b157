import sys

from modelyard.gateway.cli import main

sys.exit(main())
