-- The protocol and release each node's agent last said it speaks (issue 21, item 3), written
-- when they change.
ALTER TABLE nodes ADD COLUMN agent_protocol TEXT;
ALTER TABLE nodes ADD COLUMN agent_release TEXT;
