-- The span of the request that created a batch, as W3C trace context (`traceparent`, then `tracestate` on a second
-- line if any): each line's span links to it, on whichever replica runs the line. NULL when traces were off.
ALTER TABLE batches ADD COLUMN trace_context TEXT;
