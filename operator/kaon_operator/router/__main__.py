import sys

from kaon_operator.router.main import main

sys.exit(main())
