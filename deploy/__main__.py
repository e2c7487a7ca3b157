import sys

from modelyard.deploy.cli import main

sys.exit(main())
