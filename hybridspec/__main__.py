import sys

from hybridspec.cli import main

sys.exit(main())
