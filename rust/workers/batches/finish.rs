//! A batch's end on this replica: its output and error files written from the recorded results, and its final
//! status, under its claim.

use super::object::{Batch, BatchErrors, BatchStatus};
use super::run::{FULL, Lease, Runner};
use crate::error::ApiError;
use crate::owner::Owner;
use crate::store::{DISK_FULL, StoreError, items};
use axum::body::Bytes;
use futures_util::StreamExt;

/// Lines of the output files read from the store at a time.
const PAGE: i64 = 512;

impl Runner {
    /// Write the output and error files from the recorded results, then end as `status`.
    /// A results file that does not fit (the caps, or a full disk) ends the batch `failed`, saying so, with nothing
    /// half-written kept. None if the claim was lost (another replica writes them), or if the batch cannot end so.
    pub(super) async fn finish(
        &self,
        id: &str,
        batch: &mut Batch,
        whose: &Owner,
        mut status: BatchStatus,
        lease: &mut Lease<'_>,
    ) -> Result<Option<BatchStatus>, StoreError> {
        // Files are not fenced by the claim: renewed first, so a run that lost it writes none.
        if !self.renew(id, lease).await? {
            self.lost(id, lease.claim, 0, 0);
            return Ok(None);
        }
        let (done, failed) = self.store.db.done_lines(id).await?;
        batch.set_counts(batch.request_counts.total, done.len() as i64 - failed, failed);
        let expires_after = batch.output_expires_after;
        for ok in [true, false] {
            if file_id(batch, ok).is_some() || (ok && done.len() as i64 == failed) || (!ok && failed == 0) {
                continue;
            }
            match self.results_file(id, ok, whose, expires_after).await {
                Ok(file) => *file_id(batch, ok) = Some(file),
                // The store down or busy is not the batch's fault: the run stops, and runs again once it is back.
                Err(ApiError::StoreUnavailable(why)) if why != DISK_FULL => return Err(StoreError::Unavailable(why)),
                Err(e @ (ApiError::FilesFull { .. } | ApiError::StoreUnavailable(_))) => {
                    tracing::warn!(batch_id = %id, "a batch's results file did not fit: {e}");
                    batch.errors = Some(BatchErrors::of(&[(0, FULL, format!("Its results file was not kept: {e}"))]));
                    status = BatchStatus::Failed;
                }
                Err(e) => tracing::error!(batch_id = %id, "could not write a batch's results file: {e}"),
            }
        }
        if status != BatchStatus::Completed {
            let was = batch.status;
            if let Err(e) = batch.set_status(status, items::now()) {
                tracing::error!(batch_id = %id, "a batch did not end: {e}");
                return Ok(None);
            }
            self.store
                .db
                .set_batch(id, was.as_str(), batch.status.as_str(), &batch.to_text(), Some(lease.claim))
                .await?;
        }
        Ok(Some(status))
    }

    /// One file of results (the succeeded or the failed lines) in line order, expiring `expires_after` seconds from
    /// now if the batch asked (`output_expires_after`); its id.
    async fn results_file(
        &self,
        id: &str,
        ok: bool,
        whose: &Owner,
        expires_after: Option<i64>,
    ) -> Result<String, ApiError> {
        let db = self.store.db.clone();
        let (id, from) = (id.to_string(), 0i64);
        let pages = futures_util::stream::unfold(Some(from), move |from| {
            let (db, id) = (db.clone(), id.clone());
            async move {
                let from = from?;
                let page = db.results(&id, ok, from, PAGE).await;
                match page {
                    Ok(rows) if rows.is_empty() => None,
                    Ok(rows) => {
                        let next = rows.last().map(|(line, _)| line + 1);
                        let text: String = rows.iter().map(|(_, r)| format!("{r}\n")).collect();
                        Some((Ok::<_, StoreError>(Bytes::from(text)), next))
                    }
                    Err(e) => Some((Err(e), None)),
                }
            }
        });
        let up = self.store.receive(pages.boxed(), whose).await?;
        let name = if ok { "batch_output.jsonl" } else { "batch_errors.jsonl" };
        let file = self.store.keep_file(up, name, "batch_output", expires_after).await?;
        Ok(file["id"].as_str().unwrap_or_default().to_string())
    }
}

/// Where the batch names its output file (`ok`) or its error file.
fn file_id(batch: &mut Batch, ok: bool) -> &mut Option<String> {
    if ok { &mut batch.output_file_id } else { &mut batch.error_file_id }
}
