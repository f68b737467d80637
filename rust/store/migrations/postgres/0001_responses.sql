-- Stored responses (OpenAI Responses API: store, previous_response_id, GET/DELETE, input_items).
-- `context`: the items of the chain before this response's own input (what previous_response_id carried over);
-- `input_items`: this request's own input items; `response`: the Response object as the client got it.
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at BIGINT NOT NULL,
    model TEXT NOT NULL,
    previous_response_id TEXT,
    context TEXT NOT NULL,
    input_items TEXT NOT NULL,
    response TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
