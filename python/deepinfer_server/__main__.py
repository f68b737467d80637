import sys

from deepinfer_server.cli import main

sys.exit(main())
