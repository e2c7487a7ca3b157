import sys

from modelyard.process.logs import quiet_grpc_core

quiet_grpc_core()  # before service.cli imports grpc

from modelyard.service.cli import main  # noqa: E402

sys.exit(main())
