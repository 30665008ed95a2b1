import sys

from kaon_operator.router.start import main

sys.exit(main())
