"""``python -m megatron_lossfix.patches apply|check|revert|list PATH``: the public command
(docs/design.md §3) stays at this address; the tool is
:mod:`megatron_lossfix.integrations.megatron_lm.patches`.
"""

import sys

from megatron_lossfix.integrations.megatron_lm.patches import main

if __name__ == "__main__":
    sys.exit(main())
