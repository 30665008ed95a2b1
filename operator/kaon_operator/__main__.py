import sys

from kaon_operator.main import main

sys.exit(main())
