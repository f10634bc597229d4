import sys

from sidecar.service.cli import main

sys.exit(main())
