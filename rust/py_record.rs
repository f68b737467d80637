//! `py_record!`: a settings struct Rust uses as it is, that Python builds by keyword and reads back by field
//! (a frozen `#[pyclass]` with a keyword-only constructor naming every field, and a getter for each). Python
//! cannot hand over a dict with a key misspelt or missing: the constructor refuses it where it is built, and
//! `_native.pyi` types it, checked by `mypy.stubtest` (tests/test_seam.py) against what this expands to.

/// `py_record! { /// doc.. #[derive(..)] pub struct Name { /// doc.. pub field: Type, .. } }`.
macro_rules! py_record {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[doc = $doc:literal])* pub $field:ident: $ty:ty, )+
        }
    ) => {
        $(#[$meta])*
        #[pyo3::pyclass(module = "deepinfer_server._native", frozen, get_all, from_py_object)]
        pub struct $name {
            $( $(#[doc = $doc])* pub $field: $ty, )+
        }

        #[pyo3::pymethods]
        impl $name {
            #[new]
            #[pyo3(signature = (*, $($field),+))]
            #[allow(clippy::too_many_arguments)] // keyword-only: Python names every one
            fn py_new($($field: $ty),+) -> Self {
                $name { $($field),+ }
            }
        }
    };
}

pub(crate) use py_record;
