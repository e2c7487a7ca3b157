import sys

from stack.cli import main

sys.exit(main())
