import sys

from mtpfactory.cli import main

sys.exit(main())
