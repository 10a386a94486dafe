"""fiberserve as a Ray Serve application: several replicas behind one HTTP endpoint (``fiberserve serve
--replicas N``); needs the ``ray`` extra."""
