import sys

from effpretrain.cli import main

sys.exit(main())
