module kaon.local/pause

go 1.26.0
